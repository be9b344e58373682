"""One data-plane connection on the shard side (ps/server/doors/dataplane.py holds the listener):
its hello, then push and pull frames until it ends. Pushes and pulls go through
ps/server/doors/calls.py's PushCall and start_pull / start_pull_early, as the servicer's
do, so both doors refuse the same things with the same words."""

from __future__ import annotations

import hmac
import logging
import socket
import time
from typing import Any, Protocol

import grpc

from psar.ps import framing as fr
from psar.ps import sealed, serde, shm
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.errors import InvalidArgument, PSError, bound_details
from psar.ps.server.doors import dataplane_rows
from psar.ps.server.doors.calls import PushCall, start_pull, start_pull_early
from psar.ps.server.metrics.recorder import ShardRecorder
from psar.ps.server.shard import ShardState

log = logging.getLogger(__name__)

_DRAIN_AFTER_ERROR_S = 2.0


class Listener(Protocol):
    """What a connection uses of its listener (ps/server/doors/dataplane.py's
    DataPlaneServer): the shard, the bounds, and the listener's own bookkeeping."""

    state: ShardState
    metrics: ShardRecorder
    token: str
    max_payload_bytes: int
    idle_s: float
    frame_s: float
    seal_records: bool
    shm: bool

    def _count(self, key: str, n: int = 1) -> None: ...
    def _supersede(self, worker: int, conn: _Connection) -> None: ...
    def _push_began(self, worker: int, conn: _Connection) -> None: ...
    def _push_ended(self, worker: int, conn: _Connection) -> None: ...
    def _rehome(self, old: socket.socket, new: socket.socket) -> None: ...


class _Refused(PSError):
    """A connection-level refusal (hello): answer with its code, then close."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Connection:
    def __init__(self, server: Listener, sock: socket.socket) -> None:
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
        self.segment: shm.Segment | None = None
        """The worker's shared-memory segment, once attached (ps/shm.py)."""

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
                elif kind == "rows_pull":
                    dataplane_rows.serve_pull(self, frame.rows_pull, plen)
                elif kind == "tables_pull":
                    dataplane_rows.serve_tables_pull(self, frame.tables_pull, plen)
                elif kind == "rows_push":
                    dataplane_rows.serve_push(self, frame.rows_push, plen)
                else:
                    raise fr.FramingError(
                        InvalidArgument(
                            f"unexpected {kind} frame: a call starts with push_header, "
                            "pull_request, rows_pull, tables_pull or rows_push",
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
        except Exception as e:  # noqa: BLE001 - a bug the checks missed: say so, never drop
            log.exception("data-plane connection: unexpected error")
            self._close_with(
                grpc.StatusCode.INTERNAL,
                f"internal error on this data-plane connection ({type(e).__name__}: {e}); "
                "a push in it applies nothing: retry it on a new connection, and report "
                "this with the shard's log",
            )
        finally:
            if self.segment is not None:
                self.segment.close()

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
            if isinstance(self.sock, sealed.SealedSocket):
                self.sock.send_close()  # the authenticated end: not read as a cut
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
        if hello.seal_share and self.server.seal_records:
            self._seal(bytes(hello.seal_share))
        elif hello.shm_path and self._attach(hello.shm_path, bytes(hello.shm_nonce)):
            self._send(pb.DataFrame(status=pb.DataStatus(code=0, shm=True)))
        else:
            self._status(grpc.StatusCode.OK, "")
        self.metrics.data_connection("shm" if self.segment is not None else "socket")

    def _attach(self, path: str, nonce: bytes) -> bool:
        """The worker's shared-memory segment, where this shard may and can attach and
        the segment is the connecting peer's own (ps/shm.py: the process the path names
        holds this connection's socket): a segment refused is not an error (another
        host, another PID namespace), the connection keeps the socket."""
        if not self.server.shm or self.server.tls:
            return False
        try:
            self.segment = shm.Segment.attach(path, nonce, self.sock)
        except shm.SegmentRefused:
            self.server._count("shm_refused")
            return False
        self.server._count("shm")
        return True

    def _seal(self, worker_share: bytes) -> None:
        """Answer OK with the shard's share, close TLS, go on in sealed records."""
        if len(worker_share) != sealed.SHARE_BYTES:
            raise _Refused(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"hello seal_share of {len(worker_share)} bytes; it must be "
                f"{sealed.SHARE_BYTES} random bytes (or empty to keep TLS records)",
            )
        share = sealed.new_share()
        to_shard, to_worker = sealed.derive_keys(worker_share, share)
        self._send(fr.status_frame_sealing(share))
        old = self.sock
        self.sock.settimeout(self.server.frame_s)
        self.sock = sealed.seal(old, to_worker, to_shard, record_timeout_s=self.server.frame_s)
        self.server._rehome(old, self.sock)
        self.server._count("sealed")

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
                        call.verdict(frame.verdict)
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
        if call.ticket is not None:
            waited = self.state.intake.pace_push(call.ticket, piece.offset)
            if waited and self.clock.deadline is not None:
                self.clock.deadline += waited  # the shard's delay, not the sender's
        if piece.shm_bytes:
            self._shm_piece(call, piece, plen)
            return
        deadline = self.clock.deadline
        read_into = lambda view: fr.recv_exact(self.sock, view, deadline=deadline)  # noqa: E731
        read = lambda n: fr.recv_payload(self.sock, n, self.scratch, deadline)  # noqa: E731
        try:
            call.piece(piece.key, piece.offset, plen, read_into, read)
        except PSError:
            self._discard(plen)  # nothing was read yet
            raise

    def _shm_piece(self, call: PushCall, piece: pb.DataPiece, plen: int) -> None:
        """A pushed piece whose bytes lie in the connection's segment: copied out of it
        straight into the staging buffer (fp32), checked like any piece first."""
        segment, at = self.segment, piece.shm_at
        data = self.segment_bytes(
            "piece", at, piece.shm_bytes, plen, "give the offset its earlier pieces reached"
        )

        def read_into(view: memoryview) -> None:
            segment.copy_out(at, len(data), view)

        try:
            call.piece(piece.key, piece.offset, len(data), read_into, lambda _n: data)
        finally:
            segment.consumed(at, len(data))  # read (or refused): the worker may reuse it

    def segment_bytes(self, what: str, at: int, n: int, plen: int, where: str) -> memoryview:
        """The `n` bytes a `what` frame names at `at` in this connection's segment (its
        payload, if any, read and dropped first); InvalidArgument where they cannot be
        (no segment, a payload too, an end past the 64-bit position the segment counts
        in: `where` says what to give instead, outside the ring)."""
        if plen:
            self._discard(plen)
        if self.segment is None or plen:
            raise InvalidArgument(
                f"a {what} names shared-memory bytes but "
                + ("also carries a payload" if plen else "this connection has no segment")
                + ": send its bytes in the frame",
                reason="malformed",
            )
        if at + n >= 1 << 64:  # its end is stored as a u64 (shm.CONSUMED)
            raise InvalidArgument(
                f"{what} shm_at {at} + shm_bytes {n} is past the 64-bit stream position a "
                f"segment counts in: {where}",
                reason="malformed",
            )
        try:
            return self.segment.get(at, n)
        except ValueError as e:
            raise InvalidArgument(
                f"{what}: {e}: send its bytes in the frame", reason="malformed"
            ) from None

    def _send_piece(self, key: str, offset: int, data: Any) -> None:
        """A pulled piece: into the worker's segment where it fits (the frame then says
        where), else in the frame."""
        if self.segment is not None:
            view = memoryview(data).cast("B")
            at = self.segment.put(view)
            if at is not None:
                piece = pb.DataPiece(key=key, offset=offset, shm_at=at, shm_bytes=len(view))
                self._send(pb.DataFrame(piece=piece))
                return
        self._send(pb.DataFrame(piece=pb.DataPiece(key=key, offset=offset)), data)

    def _refuse(self, e: PSError) -> bool:
        self.metrics.push_rejected(e.reason)
        self._status(e.code, e.args[0])
        return True

    # ---- pull -----------------------------------------------------------------------

    def _pull(self, req: pb.DataPullRequest) -> None:
        t0 = time.monotonic()
        if self.segment is not None:
            self.segment.begin()
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
                    self._send_piece(key, offset, data)
                self._send(pb.DataFrame(end=pb.DataEnd()))
        except PSError as e:
            self._status(e.code, e.args[0])
        finally:
            self.metrics.rpc_observed("Pull", time.monotonic() - t0)

    def _pull_early(self, req: pb.DataPullRequest, timeout: float) -> None:
        """Pieces as the round applies them, the header once it closed, the rest
        (ps/server/pulls/early.py). A refusal before or after the early pieces is a
        status frame in place of the next piece or header."""
        # The worker sends nothing until this answer ends: anything readable means it
        # hung up (its push failed and it cut this pull short), so stop waiting for it.
        alive = lambda: not fr.peer_spoke(self.sock)  # noqa: E731
        for item in start_pull_early(self.state, req.request, timeout, views=True, alive=alive):
            if item[0] == "header":
                self._send(pb.DataFrame(pull_header=item[1]))
            else:
                _, key, offset, data = item
                self._send_piece(key, offset, data)
        self._send(pb.DataFrame(end=pb.DataEnd()))
