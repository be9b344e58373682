"""Worker side of the data plane (ps/server/doors/dataplane.py): push and pull frames to one shard.

One DataPlaneClient per shard, thread-safe: each call takes an idle pooled connection or
opens one (hello with the token and protocol version first). It is the TCP door of the
transport contract (ps/client/transport.py, which has the push and pull logic and the
checks of both doors): tensor bytes go out as memoryviews of the caller's tensors (no
copy) and come back straight into the caller's buffers where the dtype matches.

Errors are DataPlaneError (the contract's TransportError), a grpc.RpcError with .code()
and .details() like gRPC's, so retry logic written for gRPC handles both: connection
refused, reset or closed mid-call -> UNAVAILABLE; deadline -> DEADLINE_EXCEEDED;
cancel_all() -> CANCELLED; a shard's refusal -> its status code and details verbatim
(e.g. ABORTED "restored: ...").

Under TLS (`ssl_context`, from client_ssl_context: the same --tls-ca, --tls-cert and
--tls-key as the worker's gRPC channels) every connection is TLS, the shard's certificate
checked against `server_name` (--tls-server-name, else the host), in standard TLS
records. The hello offers sealed records (ps/sealed.py: AES-GCM under keys the two ends
agree inside TLS); only a shard with the opt-in --data-sealed-records agrees
(docs/sealed-records.md), and then the connection leaves TLS after the hello.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc

from psar.ps import framing as fr
from psar.ps import sealed, shm
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.locality import is_this_host
from psar.ps.client.transport import Incoming, Piece, PullStream, Transport, TransportError, Verdict

DEFAULT_MAX_FRAME_BYTES = 4 << 20
"""Tensor bytes per piece frame sent; at most the shard's --max-message-bytes (16 MiB)."""
PULL_GRACE_S = 1.0
"""A pull waits this much past its timeout for the shard's own DEADLINE_EXCEEDED (which
says who it waited for) before giving up locally."""

SC = grpc.StatusCode

DataPlaneError = TransportError
"""What a failed data-plane call raises (the contract's error, under its old name)."""


def client_ssl_context(ca: str = "", cert: str = "", key: str = "") -> ssl.SSLContext:
    """TLS to a shard's data plane, as ps/auth.py's channel_credentials for gRPC: trust
    `ca` (the system roots without one) and present cert/key when given (mutual TLS)."""
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both --tls-cert and --tls-key")
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca or None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


class _Conn:
    __slots__ = ("sock", "scratch", "cancelled", "segment")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.scratch = fr.Scratch()
        self.cancelled = False
        self.segment: shm.Segment | None = None
        """The shared-memory segment the shard attached to (ps/shm.py), if any."""

    def close(self) -> None:
        self.sock.close()
        if self.segment is not None:
            self.segment.close()
            self.segment = None


class DataPlaneClient(Transport):
    """Push and pull to one shard's data plane (HOST, GetJobReply.data_port)."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        token: str = "",
        connect_timeout_s: float = 10.0,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        ssl_context: ssl.SSLContext | None = None,
        server_name: str = "",
        seal_records: bool = True,
        shm_bytes: int = 0,
    ) -> None:
        if not 0 < port < 65536:
            raise ValueError(f"data-plane port must be in [1, 65535], got {port}")
        if max_frame_bytes < 4:
            raise ValueError(f"max_frame_bytes must be >= 4 (one element), got {max_frame_bytes}")
        self.host, self.port = host.strip("[]"), port
        self.address = f"{self.host}:{self.port}"
        self.token = token
        self.connect_timeout_s = connect_timeout_s
        self.max_frame_bytes = max_frame_bytes
        self.ssl_context = ssl_context
        self.server_name = server_name or self.host
        self.seal_records = seal_records
        """Under TLS, offer the shard sealed records after the hello (ps/sealed.py); only a
        shard started with --data-sealed-records agrees, the others keep TLS records."""
        self.shm_bytes = shm_bytes if ssl_context is None and shm.available() else 0
        """Offer each connection a shared-memory segment of this many bytes when the shard
        is on this host (ps/shm.py; never under TLS); 0: every byte in the socket."""
        self._local: bool | None = None
        self._idle: list[_Conn] = []
        self._busy: set[_Conn] = set()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def piece_bytes(self) -> int:
        return self.max_frame_bytes

    def in_shared_memory(self) -> bool:
        """Has the shard attached a shared-memory segment of one of this client's open
        connections (ps/shm.py: it is on this host)?"""
        with self._lock:
            return any(c.segment is not None for c in (*self._idle, *self._busy))

    # ---- the primitives (push() and pull() are the contract's) ------------------------

    def send_push(
        self, header: pb.PushHeader, parts: Iterator[Piece | Verdict], *, timeout_s: float
    ) -> pb.PushReply:
        deadline = time.monotonic() + timeout_s
        conn = self._acquire(deadline)
        reusable = False
        if conn.segment is not None:
            conn.segment.begin()
        try:
            try:
                self._send(conn, pb.DataFrame(push_header=header), None, deadline)
                for part in parts:
                    if isinstance(part, Verdict):
                        verdict = part.to_pb()
                        self._send(conn, pb.DataFrame(verdict=verdict), None, deadline)
                        continue
                    self._send_piece(conn, part, deadline)
                    self._refused_early(conn, deadline)
                self._send(conn, pb.DataFrame(end=pb.DataEnd()), None, deadline)
            except DataPlaneError as e:
                if e.code() in (SC.UNAVAILABLE, SC.DEADLINE_EXCEEDED) and not conn.cancelled:
                    self._status_after_send_failure(conn)  # the shard's reason, if it sent one
                raise
            frame = self._recv_frame(conn, deadline, "push")
            reusable = True
            return self._expect(frame, "push_reply")
        finally:
            self._release(conn, reusable)

    def _send_piece(self, conn: _Conn, part: Piece, deadline: float) -> None:
        """One pushed piece: into the connection's segment where it fits (the frame says
        where), else in the frame."""
        if conn.segment is not None:
            view = memoryview(part.data).cast("B")
            at = conn.segment.put(view)
            if at is not None:
                piece = pb.DataPiece(
                    key=part.key, offset=part.offset, shm_at=at, shm_bytes=len(view)
                )
                self._send(conn, pb.DataFrame(piece=piece), None, deadline)
                return
        piece = pb.DataPiece(key=part.key, offset=part.offset)
        self._send(conn, pb.DataFrame(piece=piece), part.data, deadline)

    def open_pull(self, req: pb.PullRequest, *, timeout_s: float) -> PullStream:
        deadline = time.monotonic() + timeout_s
        conn = self._acquire(deadline)
        try:
            ask = pb.DataPullRequest(request=req, timeout_s=timeout_s)
            self._send(conn, pb.DataFrame(pull_request=ask), None, deadline)
        except BaseException:
            self._release(conn, False)
            raise
        return _TcpPull(self, conn, deadline + PULL_GRACE_S)

    def cancel_all(self) -> None:
        """Abort every call in flight (from another thread): they raise CANCELLED."""
        with self._lock:
            busy = list(self._busy)
        for c in busy:
            _cancel(c)

    def close(self) -> None:
        """Close the pooled connections and abort calls in flight."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
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
            # An idle connection with something to read was closed (or broken) by the
            # shard (its idle limit, a restart).
            if not _readable(conn.sock):
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
        conn.close()

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
        try:
            fr.tune(sock)
            if self.ssl_context is not None:
                sock = self._handshake(sock, deadline)
        except BaseException:
            sock.close()
            raise
        conn = _Conn(sock)
        segment = self._new_segment()
        try:
            share = sealed.new_share() if self._offer_seal() else b""
            hello = pb.DataHello(token=self.token, version=fr.VERSION, seal_share=share)
            if segment is not None:
                hello.shm_path, hello.shm_nonce = segment.path, segment.nonce
            self._send(conn, pb.DataFrame(hello=hello), None, deadline)
            frame = self._recv_frame(conn, deadline, "hello")
            if frame.WhichOneof("kind") != "status" or frame.status.code != 0:
                self._unexpected(frame, "status OK")
            if share and frame.status.seal_share:
                conn.sock = self._seal(conn.sock, share, bytes(frame.status.seal_share), deadline)
            if segment is not None and frame.status.shm:
                segment.offered()
                conn.segment, segment = segment, None
        except BaseException:
            conn.close()
            sock.close()
            raise
        finally:
            if segment is not None:  # not offered, or the shard did not attach
                segment.close()
        return conn

    def _new_segment(self) -> shm.Segment | None:
        """A segment to offer, where the shard is on this host (decided once)."""
        if not self.shm_bytes:
            return None
        if self._local is None:
            self._local = is_this_host(self.host)
        if not self._local:
            return None
        try:
            return shm.Segment.create(self.shm_bytes)
        except OSError:  # no memfd here (or no memory for one): the socket will do
            self.shm_bytes = 0
            return None

    def _offer_seal(self) -> bool:
        return self.ssl_context is not None and self.seal_records and sealed.available()

    def _seal(
        self, sock: socket.socket, share: bytes, shard_share: bytes, deadline: float
    ) -> socket.socket:
        """The shard agreed: close TLS, carry the rest in sealed records (ps/sealed.py)."""
        try:
            to_shard, to_worker = sealed.derive_keys(share, shard_share)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            return sealed.seal(sock, to_shard, to_worker)
        except ValueError as e:  # a share of the wrong length
            raise DataPlaneError(
                SC.UNAVAILABLE, f"data plane of {self.address}: bad sealed-records answer: {e}"
            ) from None
        except (OSError, ssl.SSLError) as e:
            raise DataPlaneError(
                SC.UNAVAILABLE,
                f"data plane of {self.address}: closing TLS for sealed records failed: {e}",
            ) from None

    def _handshake(self, sock: socket.socket, deadline: float) -> socket.socket:
        assert self.ssl_context is not None
        sock.settimeout(max(0.001, min(self.connect_timeout_s, deadline - time.monotonic())))
        try:
            return self.ssl_context.wrap_socket(sock, server_hostname=self.server_name)
        except ssl.SSLCertVerificationError as e:
            raise DataPlaneError(
                SC.UNAVAILABLE,
                f"data plane of {self.address}: TLS certificate not trusted "
                f"({e.verify_message}); is --tls-ca the CA that signed the shard's "
                "certificate, and --tls-server-name the name in it?",
            ) from None
        except (OSError, ssl.SSLError) as e:
            raise DataPlaneError(
                SC.UNAVAILABLE, f"data plane of {self.address}: TLS handshake failed: {e}"
            ) from None

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
        if _readable(conn.sock):
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

    def _expect(self, frame: pb.DataFrame, kind: str) -> Any:
        """The reply `frame` carries when it is of `kind`; else its status (a refusal)
        or a frame it should not be, raised."""
        if frame.WhichOneof("kind") != kind:
            self._unexpected(frame, kind)
        return getattr(frame, kind)

    def _unexpected(self, frame: pb.DataFrame, wanted: str) -> NoReturn:
        if frame.WhichOneof("kind") == "status":
            code = fr.CODE_BY_NUMBER.get(frame.status.code, SC.UNKNOWN)
            raise DataPlaneError(code, frame.status.details)
        raise DataPlaneError(
            SC.INTERNAL,
            f"data plane of {self.address}: got a {frame.WhichOneof('kind')} frame, expected {wanted}",
        )


def _cancel(conn: _Conn) -> None:
    """Abort the call on `conn` from another thread: its blocked send or recv fails, and
    the call raises CANCELLED (conn.cancelled) instead of UNAVAILABLE."""
    conn.cancelled = True
    fr.hard_shutdown(conn.sock)


def _readable(sock: socket.socket) -> bool:
    """Something to read now (TLS: decrypted bytes buffered, or raw bytes waiting)."""
    if fr.is_tls(sock) and sock.pending():  # type: ignore[attr-defined]
        return True
    return bool(select.select([sock], [], [], 0)[0])


class _TcpPull(PullStream):
    """A pull on one pooled connection; the connection goes back to the pool only when
    the pull ended cleanly (its end frame, or a refusal in place of the header)."""

    def __init__(self, client: DataPlaneClient, conn: _Conn, deadline: float) -> None:
        self._client, self._conn, self._deadline = client, conn, deadline
        self._reusable = False
        self._closed = False

    def header(self) -> pb.PullHeader:
        frame = self._client._recv_frame(self._conn, self._deadline, "pull")
        if frame.WhichOneof("kind") != "pull_header":
            self._reusable = frame.WhichOneof("kind") == "status"
            self._client._unexpected(frame, "pull_header")
        return frame.pull_header

    def next_early(self) -> Incoming | pb.PullHeader:
        c = self._client
        frame, plen = c._io(self._conn, self._deadline, "pull", c._read_header, self._conn)
        kind = frame.WhichOneof("kind")
        if kind == "pull_header":
            return frame.pull_header
        if kind != "piece":
            self._reusable = kind == "status"
            c._unexpected(frame, "piece or pull_header")
        return self._piece(frame.piece, plen)

    def next_piece(self) -> Incoming | None:
        c = self._client
        frame, plen = c._io(self._conn, self._deadline, "pull", c._read_header, self._conn)
        kind = frame.WhichOneof("kind")
        if kind == "end":
            self._reusable = True
            return None
        if kind != "piece":
            c._unexpected(frame, "piece")
        return self._piece(frame.piece, plen)

    def _piece(self, piece: pb.DataPiece, plen: int) -> Incoming:
        if not piece.shm_bytes:
            return _SocketPiece(self, piece.key, piece.offset, plen)
        segment = self._conn.segment
        try:
            if segment is None or plen:
                raise ValueError("a payload too" if plen else "no segment on this connection")
            data = segment.get(piece.shm_at, piece.shm_bytes)
        except ValueError as e:
            raise DataPlaneError(
                SC.INTERNAL,
                f"data plane of {self._client.address}: bad shared-memory piece: {e}",
            ) from None
        return _SegmentPiece(piece.key, piece.offset, data, segment, piece.shm_at)

    def read_into(self, view: memoryview) -> None:
        c = self._client
        c._io(self._conn, self._deadline, "pull", fr.recv_exact, self._conn.sock, view)

    def read(self, n: int) -> memoryview:
        c, conn = self._client, self._conn
        return c._io(conn, self._deadline, "pull", fr.recv_payload, conn.sock, n, conn.scratch)

    def cancel(self) -> None:
        _cancel(self._conn)

    def close(self) -> None:
        if not self._closed:  # released once: twice would pool the connection twice
            self._closed = True
            self._client._release(self._conn, self._reusable)


class _SocketPiece:
    """A pulled piece whose payload is still in the socket (read it exactly once)."""

    __slots__ = ("key", "offset", "nbytes", "_pull")

    def __init__(self, pull: _TcpPull, key: str, offset: int, nbytes: int) -> None:
        self._pull, self.key, self.offset, self.nbytes = pull, key, offset, nbytes

    def read_into(self, view: memoryview) -> None:
        self._pull.read_into(view)

    def read(self) -> memoryview:
        return self._pull.read(self.nbytes)


class _SegmentPiece:
    """A pulled piece whose bytes lie in the connection's shared-memory segment."""

    __slots__ = ("key", "offset", "nbytes", "_data", "_segment", "_at")

    def __init__(
        self, key: str, offset: int, data: memoryview, segment: shm.Segment, at: int
    ) -> None:
        self.key, self.offset, self.nbytes, self._data = key, offset, len(data), data
        self._segment, self._at = segment, at

    def read_into(self, view: memoryview) -> None:
        self._segment.copy_out(self._at, self.nbytes, view)

    def read(self) -> bytes:
        data = bytes(self._data)  # a copy: the shard may write over the ring once read
        self._segment.consumed(self._at, self.nbytes)
        return data
