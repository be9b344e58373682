"""The shard's data plane: push and pull over plain TCP frames, next to gRPC.

Python gRPC tops out at ~1.4-2 GB/s on loopback here (protobuf copies, 1 MiB messages
through the C core); these frames (ps/framing.py, proto/psar/v1/ps.proto) carry the
same push and pull with one copy on each end. It is a second door to the SAME shard:
pushes and pulls are decoded and validated by the servicer's PushCall and start_pull
(ps/server/servicer.py), which every decision then leaves to ShardState, so errors get
the status codes and messages gRPC gives, and the same metrics are counted. gRPC keeps
everything else (init, jobs, leases, stats, health).

One thread per connection (workers keep a few pooled connections per shard). A refused
push gets its status at once; the rest of that push is read and ignored up to its end
frame, so the connection stays usable. A frame that cannot be read (bad magic, lengths
over the limits, an unknown kind) gets its status, then the connection is closed.

Bounds per connection, so a peer cannot hold more than it sends (docs/dataplane.md):
buffers grow as bytes arrive (ps/framing.py Scratch; a piece's fp32 bytes go straight
into the staging buffer) and never past the largest frame; a frame must be complete
within `frame_s` of its first byte; a connection with no frame for `idle_s` (the TLS
handshake and the hello included) is closed; TCP keepalive; at most `max_conns_per_peer`
connections per peer address (more get RESOURCE_EXHAUSTED); and a push header of worker
W supersedes W's push still streaming on another connection (that connection is cut, its
push released unapplied), so a stalled connection cannot make W's retry wait.

Under TLS (`ssl_context`: the shard's --tls-cert/--tls-key, --tls-ca for mutual TLS) every
connection is TLS from its first byte; the token is checked in the hello as before.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import ssl
import threading
import time
from typing import Any

import grpc

from ps import framing as fr
from ps import serde
from ps._gen.psar.v1 import ps_pb2 as pb
from ps.errors import InvalidArgument, PSError, bound_details
from ps.server.servicer import PushCall, start_pull, start_pull_early
from ps.server.shard import ShardState

log = logging.getLogger("psar.dataplane")

_DRAIN_AFTER_ERROR_S = 2.0
DEFAULT_IDLE_S = 300.0
"""Close a data-plane connection with no frame for this long (psar server --data-idle-s)."""
DEFAULT_FRAME_S = 30.0
"""A frame (16 MiB at most) must arrive within this long of its first byte."""
DEFAULT_MAX_CONNS_PER_PEER = 256
"""Connections one peer address may hold (psar server --data-max-conns-per-peer)."""


class _Refused(PSError):
    """A connection-level refusal (hello): answer with its code, then close."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class DataPlaneServer:
    """A TCP listener serving push and pull frames for one ShardState."""

    def __init__(
        self,
        state: ShardState,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str = "",
        max_payload_bytes: int = 16 << 20,
        idle_s: float = DEFAULT_IDLE_S,
        frame_s: float = DEFAULT_FRAME_S,
        max_conns_per_peer: int = DEFAULT_MAX_CONNS_PER_PEER,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        if not (idle_s > 0 and frame_s > 0 and max_conns_per_peer >= 1):
            raise ValueError("data plane: idle_s, frame_s > 0 and max_conns_per_peer >= 1")
        self.state = state
        self.metrics = state.metrics
        self.token = token
        self.max_payload_bytes = max_payload_bytes
        self.idle_s, self.frame_s = idle_s, frame_s
        self.max_conns_per_peer = max_conns_per_peer
        self.ssl_context = ssl_context
        self._per_peer: dict[str, int] = {}
        self._pushing: dict[int, _Connection] = {}
        """Worker -> the connection whose push of that worker is streaming."""
        self._counts = dict.fromkeys(STAT_KEYS, 0)
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self.port: int = self._listener.getsockname()[1]
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="psar-data-accept", daemon=True
        )

    def start(self) -> DataPlaneServer:
        self._acceptor.start()
        return self

    @property
    def tls(self) -> bool:
        return self.ssl_context is not None

    def stats(self) -> dict[str, int]:
        """Counters of this data plane (tests, tools): connections accepted and open,
        bytes their buffers hold now and at most, pushes and pulls served, connections
        refused or closed by the bounds."""
        with self._lock:
            out = dict(self._counts)
            out["connections"] = len(self._conns)
        return out

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n
            if key == "buffered_bytes":
                peak = self._counts["peak_buffered_bytes"]
                self._counts["peak_buffered_bytes"] = max(peak, self._counts[key])

    def _supersede(self, worker: int, conn: _Connection) -> None:
        """conn starts a push of `worker`: cut the connection still streaming an accepted
        push of it (the worker gave up on that one: a retry, or a stalled peer), so that
        push is released unapplied and this one need not wait for its worker lock."""
        with self._lock:
            old = self._pushing.pop(worker, None)
        if old is not None and old is not conn:
            log.warning("data plane: a new push of worker %d supersedes its stalled one", worker)
            self._count("superseded")
            old.superseded = True
            fr.hard_shutdown(old.sock)

    def _push_began(self, worker: int, conn: _Connection) -> None:
        """conn's push of `worker` was accepted (it holds the worker's push lock)."""
        with self._lock:
            self._pushing[worker] = conn

    def _push_ended(self, worker: int, conn: _Connection) -> None:
        with self._lock:
            if self._pushing.get(worker) is conn:
                del self._pushing[worker]

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every connection (calls in flight fail), join the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns = list(self._conns)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._listener.close()
        for c in conns:
            fr.hard_shutdown(c)  # wakes a thread blocked in recv
        deadline = time.monotonic() + timeout_s
        for t in [self._acceptor, *list(self._threads)]:
            if t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))

    # ---- connections ----------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # closed
            peer = str(addr[0])
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                n = self._per_peer.get(peer, 0) + 1
                self._per_peer[peer] = n
                self._counts["accepted"] += 1
                self._conns.add(sock)
                t = threading.Thread(
                    target=self._serve,
                    args=(sock, peer, n > self.max_conns_per_peer),
                    name="psar-data-conn",
                    daemon=True,
                )
                self._threads.add(t)
            t.start()

    def _serve(self, sock: socket.socket, peer: str, over_cap: bool) -> None:
        raw = sock
        conn: _Connection | None = None
        try:
            fr.tune(sock)
            sock = self._wrap(sock)
            if sock is not raw:
                sock.do_handshake()  # type: ignore[attr-defined]
            conn = _Connection(self, sock)
            if over_cap:
                self._count("refused_peer_cap")
                conn._close_with(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"too many data-plane connections from {peer} (the limit is "
                    f"{self.max_conns_per_peer} per peer address): close idle ones, or raise "
                    "the shard's --data-max-conns-per-peer",
                )
            else:
                conn.run()
        except (OSError, ssl.SSLError, TimeoutError) as e:
            log.info("data-plane connection from %s ended: %s", peer, e)
        except Exception:  # noqa: BLE001 - one bad connection must never stop the shard
            log.exception("data-plane connection failed")
        finally:
            if conn is not None:
                conn.scratch.release()
            with self._lock:
                self._conns.discard(raw)
                self._conns.discard(sock)
                self._threads.discard(threading.current_thread())
                left = self._per_peer.get(peer, 1) - 1
                if left > 0:
                    self._per_peer[peer] = left
                else:
                    self._per_peer.pop(peer, None)
            sock.close()
            raw.close()

    def _wrap(self, sock: socket.socket) -> socket.socket:
        """The TLS socket over `sock` (the caller does the handshake, within the frame
        deadline: a peer that never completes it holds its thread no longer than that)."""
        if self.ssl_context is None:
            return sock
        sock.settimeout(min(self.frame_s, self.idle_s))
        tls = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        with self._lock:  # close() must shut the socket that owns the descriptor now
            self._conns.discard(sock)
            self._conns.add(tls)
        return tls


class _Connection:
    def __init__(self, server: DataPlaneServer, sock: socket.socket) -> None:
        self.server = server
        self.state = server.state
        self.metrics = server.metrics
        self.sock = sock
        self.scratch = fr.Scratch(lambda delta: server._count("buffered_bytes", delta))
        # The hello must come within the frame deadline, not the (long) idle limit.
        idle = min(server.idle_s, server.frame_s)
        self.clock = fr.FrameClock(idle, server.frame_s)
        self.superseded = False
        self.greeted = False

    def run(self) -> None:
        try:
            self._hello()
            self.greeted = True
            self.clock.idle_s = self.server.idle_s
            while True:
                try:
                    frame, plen = self._read()
                except fr.ConnectionClosed as e:
                    if e.mid_frame:
                        raise
                    return  # the worker closed an idle connection
                except fr.IdleTimeout:
                    self.server._count("idle_closed")
                    self._close_with(
                        grpc.StatusCode.UNAVAILABLE,
                        f"data-plane connection idle for {self.clock.idle_s:g} s, closed "
                        "(psar server --data-idle-s); open a new one",
                    )
                    return
                kind = frame.WhichOneof("kind")
                if kind == "push_header":
                    self._push(frame.push_header)
                elif kind == "pull_request":
                    self._pull(frame.pull_request)
                else:
                    raise fr.FramingError(
                        InvalidArgument(
                            f"unexpected {kind} frame: a call starts with push_header or "
                            "pull_request",
                            reason="malformed",
                        )
                    )
        except (fr.FramingError, _Refused) as e:
            self._close_with(e.code, e.args[0])
        except fr.IdleTimeout:  # before the hello, or between the frames of a push
            self.server._count("idle_closed")
            if self.greeted:
                why = "no frame of the push in flight"
            else:
                why = "no hello frame (which must open a data-plane connection)"
            self._close_with(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"{why} within {self.clock.idle_s:g} s; the connection is closed (a push "
                "in it applies nothing; psar server --data-idle-s)",
            )
        except TimeoutError:
            if self.superseded:
                return
            self.server._count("deadline_closed")
            self._close_with(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"a frame did not arrive whole (or was not read) within {self.server.frame_s:g} "
                "s of its first byte; the connection is closed (a push in it applies nothing)",
            )
        except fr.ConnectionClosed as e:
            if self.superseded:
                return
            if not e.mid_frame:
                return  # closed between frames (a port probe, or a worker giving up a call)
            self._close_with(
                grpc.StatusCode.INVALID_ARGUMENT,
                "connection closed in the middle of a frame (short prefix, header or payload)",
            )
        except OSError:
            pass  # reset by the worker, or closed by shutdown

    def _read(self) -> tuple[pb.DataFrame, int]:
        return fr.read_header(
            self.sock,
            max_payload_bytes=self.server.max_payload_bytes,
            scratch=self.scratch,
            clock=self.clock,
        )

    def _discard(self, plen: int) -> None:
        fr.discard_payload(self.sock, plen, self.scratch, self.clock.deadline)

    def _send(self, frame: pb.DataFrame, payload: Any = None) -> None:
        self.sock.settimeout(self.server.frame_s)  # a peer that stops reading is cut
        fr.send(self.sock, frame, payload)

    def _status(self, code: grpc.StatusCode, details: str) -> None:
        # Bounded like gRPC's (servicer._fail): the same words on both doors.
        self._send(fr.status_frame(code, bound_details(details)))

    def _close_with(self, code: grpc.StatusCode, details: str) -> None:
        """Answer with a status, then read (and drop) what the worker still sends for a
        moment before closing, so the status is not lost to a reset."""
        try:
            self._status(code, details)
            socket.socket.shutdown(self.sock, socket.SHUT_WR)  # TCP FIN (TLS: no close_notify)
            deadline = time.monotonic() + _DRAIN_AFTER_ERROR_S
            while True:  # small reads, dropped: no buffer of the peer's choosing
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.sock.settimeout(remaining)
                if not self.sock.recv(64 << 10):
                    break
        except (OSError, ValueError):
            pass

    def _hello(self) -> None:
        token = self.server.token
        frame, _ = self._read()
        if frame.WhichOneof("kind") != "hello":
            if token:
                self.metrics.push_rejected("unauthenticated")
                raise _Refused(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "unauthenticated: missing hello with the bearer token; a data-plane "
                    "connection must open with a hello frame carrying the shard's token",
                )
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a data-plane connection must open with a hello frame (token, version)",
            )
        hello = frame.hello
        if token and not hmac.compare_digest(hello.token.encode(), token.encode()):
            self.metrics.push_rejected("unauthenticated")
            why = "missing" if not hello.token else "wrong"
            raise _Refused(
                grpc.StatusCode.UNAUTHENTICATED,
                f"unauthenticated: {why} bearer token in the data-plane hello; give the "
                "workers the shard's --auth-token-file",
            )
        if hello.version != fr.VERSION:
            raise _Refused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"data-plane protocol version {hello.version}, this shard speaks "
                f"{fr.VERSION}: run the same psar version on workers and shards",
            )
        self._status(grpc.StatusCode.OK, "")

    # ---- push -----------------------------------------------------------------------

    def _push(self, head: pb.PushHeader) -> None:
        t0 = time.monotonic()
        call: PushCall | None = None
        refused = False
        self.server._supersede(head.worker, self)
        self.server._count("pushes")
        try:
            try:
                call = PushCall(self.state, head)
                self.server._push_began(head.worker, self)
            except PSError as e:
                refused = self._refuse(e)
            while True:
                frame, plen = self._read()
                kind = frame.WhichOneof("kind")
                if refused or kind != "piece":
                    if plen:  # the rest of a refused push is read and dropped
                        self._discard(plen)
                    if kind == "end":
                        break
                    if refused:
                        continue
                assert call is not None
                try:
                    if kind == "piece":
                        self._piece(call, frame.piece, plen)
                    elif kind == "verdict":
                        call.verdict(frame.verdict.overflow, tuple(frame.verdict.absent))
                    else:
                        call.misplaced(kind)
                except PSError as e:
                    call.release()
                    refused = self._refuse(e)
            if refused:
                return
            assert call is not None
            try:
                reply = call.finish()
            except PSError as e:
                self._refuse(e)
                return
            self._send(pb.DataFrame(push_reply=reply))
        finally:
            if call is not None:
                call.release()
            self.server._push_ended(head.worker, self)
            self.metrics.rpc_observed("Push", time.monotonic() - t0)

    def _piece(self, call: PushCall, piece: pb.DataPiece, plen: int) -> None:
        """One pushed piece: checked from its description, then received straight into
        the staging buffer (fp32). A refusal still reads its payload (the stream goes on)."""
        deadline = self.clock.deadline
        read_into = lambda view: fr.recv_exact(self.sock, view, deadline=deadline)  # noqa: E731
        read = lambda n: fr.recv_payload(self.sock, n, self.scratch, deadline)  # noqa: E731
        try:
            call.piece(piece.key, piece.offset, plen, read_into, read)
        except PSError:
            self._discard(plen)  # nothing was read yet
            raise

    def _refuse(self, e: PSError) -> bool:
        self.metrics.push_rejected(e.reason)
        self._status(e.code, e.args[0])
        return True

    # ---- pull -----------------------------------------------------------------------

    def _pull(self, req: pb.DataPullRequest) -> None:
        t0 = time.monotonic()
        self.server._count("pulls")
        try:
            # Finite, >= 0, capped (inf or 1e10 used to overflow Condition.wait and kill
            # the connection without a status); 0: no limit but the cap.
            timeout = serde.wait_seconds("pull timeout_s", req.timeout_s, zero_means_max=True)
            if req.request.early:
                self._pull_early(req, timeout)
            else:
                # views: sent as they are, no copy of the masters in sync fp32
                head, pieces = start_pull(self.state, req.request, timeout, views=True)
                self._send(pb.DataFrame(pull_header=head))
                for key, offset, data in pieces:
                    self._send(pb.DataFrame(piece=pb.DataPiece(key=key, offset=offset)), data)
                self._send(pb.DataFrame(end=pb.DataEnd()))
        except PSError as e:
            self._status(e.code, e.args[0])
        finally:
            self.metrics.rpc_observed("Pull", time.monotonic() - t0)

    def _pull_early(self, req: pb.DataPullRequest, timeout: float) -> None:
        """Pieces as the round applies them, the header once it closed, the rest
        (ps/server/early_pull.py). A refusal before or after the early pieces is a
        status frame in place of the next piece or header."""
        for item in start_pull_early(self.state, req.request, timeout, views=True):
            if item[0] == "header":
                self._send(pb.DataFrame(pull_header=item[1]))
            else:
                _, key, offset, data = item
                self._send(pb.DataFrame(piece=pb.DataPiece(key=key, offset=offset)), data)
        self._send(pb.DataFrame(end=pb.DataEnd()))


def server_ssl_context(cert: str, key: str, ca: str = "") -> ssl.SSLContext:
    """TLS of the data plane from the shard's gRPC TLS files (ps/auth.py): its
    certificate and key; with `ca`, clients must present a certificate that CA signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
        if ca:
            ctx.load_verify_locations(cafile=ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"data plane TLS: cannot load --tls-cert/--tls-key/--tls-ca: {e}"
        ) from None
    # No session tickets: sent after the handshake, they would read as data on an idle
    # pooled connection, which the worker takes for a connection the shard closed.
    ctx.num_tickets = 0
    return ctx


def start_dataplane(
    state: ShardState,
    *,
    bind: str,
    port: int,
    token: str,
    max_payload_bytes: int,
    idle_s: float = DEFAULT_IDLE_S,
    max_conns_per_peer: int = DEFAULT_MAX_CONNS_PER_PEER,
    ssl_context: ssl.SSLContext | None = None,
) -> DataPlaneServer:
    """Listen on the host of `bind` (HOST:PORT of the gRPC server) at `port` (0: free)."""
    host = bind.rpartition(":")[0]
    return DataPlaneServer(
        state,
        host=host,
        port=port,
        token=token,
        max_payload_bytes=max_payload_bytes,
        idle_s=idle_s,
        frame_s=min(DEFAULT_FRAME_S, idle_s),
        max_conns_per_peer=max_conns_per_peer,
        ssl_context=ssl_context,
    ).start()


STAT_KEYS = ("accepted", "buffered_bytes", "peak_buffered_bytes", "pushes", "pulls",
             "superseded", "idle_closed", "deadline_closed", "refused_peer_cap")  # fmt: skip

__all__ = ["DataPlaneServer", "server_ssl_context", "start_dataplane"]
