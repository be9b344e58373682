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
Plaintext only: start_server turns it off when the shard serves TLS.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import socket
import threading
import time
from typing import Any

import grpc

from ps import framing as fr
from ps import serde
from ps._gen.psar.v1 import ps_pb2 as pb
from ps.errors import InvalidArgument, PSError, bound_details
from ps.server.servicer import PushCall, start_pull
from ps.server.shard import ShardState

log = logging.getLogger("psar.dataplane")

_DRAIN_AFTER_ERROR_S = 2.0


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
    ) -> None:
        self.state = state
        self.metrics = state.metrics
        self.token = token
        self.max_payload_bytes = max_payload_bytes
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
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
        deadline = time.monotonic() + timeout_s
        for t in [self._acceptor, *list(self._threads)]:
            if t.ident is not None:
                t.join(max(0.0, deadline - time.monotonic()))

    # ---- connections ----------------------------------------------------------------

    def _accept_loop(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._conns.add(sock)
                t = threading.Thread(
                    target=self._serve, args=(sock,), name="psar-data-conn", daemon=True
                )
                self._threads.add(t)
            t.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            fr.tune(sock)
            _Connection(self, sock).run()
        except Exception:  # noqa: BLE001 - one bad connection must never stop the shard
            log.exception("data-plane connection failed")
        finally:
            with self._lock:
                self._conns.discard(sock)
                self._threads.discard(threading.current_thread())
            sock.close()


class _Connection:
    def __init__(self, server: DataPlaneServer, sock: socket.socket) -> None:
        self.server = server
        self.state = server.state
        self.metrics = server.metrics
        self.sock = sock
        self.scratch = fr.Scratch()

    def run(self) -> None:
        try:
            self._hello()
            while True:
                try:
                    frame, plen = self._read()
                except fr.ConnectionClosed as e:
                    if e.mid_frame:
                        raise
                    return  # the worker closed an idle connection
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
        except fr.ConnectionClosed as e:
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
            self.sock, max_payload_bytes=self.server.max_payload_bytes, scratch=self.scratch
        )

    def _send(self, frame: pb.DataFrame, payload: Any = None) -> None:
        fr.send(self.sock, frame, payload)

    def _status(self, code: grpc.StatusCode, details: str) -> None:
        # Bounded like gRPC's (servicer._fail): the same words on both doors.
        self._send(fr.status_frame(code, bound_details(details)))

    def _close_with(self, code: grpc.StatusCode, details: str) -> None:
        """Answer with a status, then read (and drop) what the worker still sends for a
        moment before closing, so the status is not lost to a reset."""
        try:
            self._status(code, details)
            self.sock.shutdown(socket.SHUT_WR)
            self.sock.settimeout(_DRAIN_AFTER_ERROR_S)
            deadline = time.monotonic() + _DRAIN_AFTER_ERROR_S
            sink = self.scratch.view(1 << 20)
            while time.monotonic() < deadline and self.sock.recv_into(sink):
                pass
        except OSError:
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
        try:
            try:
                call = PushCall(self.state, head)
            except PSError as e:
                refused = self._refuse(e)
            while True:
                frame, plen = self._read()
                kind = frame.WhichOneof("kind")
                if refused or kind != "piece":
                    if plen:  # the rest of a refused push is read and dropped
                        fr.recv_payload(self.sock, plen, self.scratch)
                    if kind == "end":
                        break
                    if refused:
                        continue
                assert call is not None
                try:
                    if kind == "piece":
                        self._piece(call, frame.piece, plen)
                    elif kind == "verdict":
                        call.verdict(frame.verdict.overflow)
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
            self.metrics.rpc_observed("Push", time.monotonic() - t0)

    def _piece(self, call: PushCall, piece: pb.DataPiece, plen: int) -> None:
        """One pushed piece: checked from its description, then received straight into
        the staging buffer (fp32). A refusal still reads its payload (the stream goes on)."""
        read_into = lambda view: fr.recv_exact(self.sock, view)  # noqa: E731
        read = lambda n: fr.recv_payload(self.sock, n, self.scratch)  # noqa: E731
        try:
            call.piece(piece.key, piece.offset, plen, read_into, read)
        except PSError:
            fr.recv_payload(self.sock, plen, self.scratch)  # nothing was read yet
            raise

    def _refuse(self, e: PSError) -> bool:
        self.metrics.push_rejected(e.reason)
        self._status(e.code, e.args[0])
        return True

    # ---- pull -----------------------------------------------------------------------

    def _pull(self, req: pb.DataPullRequest) -> None:
        t0 = time.monotonic()
        try:
            # Finite, >= 0, capped (inf or 1e10 used to overflow Condition.wait and kill
            # the connection without a status); 0: no limit but the cap.
            timeout = serde.wait_seconds("pull timeout_s", req.timeout_s, zero_means_max=True)
            # views: sent as they are, no copy of the masters in sync fp32
            head, pieces = start_pull(self.state, req.request, timeout, views=True)
        except PSError as e:
            self.metrics.rpc_observed("Pull", time.monotonic() - t0)
            self._status(e.code, e.args[0])
            return
        self._send(pb.DataFrame(pull_header=head))
        for key, offset, data in pieces:
            self._send(pb.DataFrame(piece=pb.DataPiece(key=key, offset=offset)), data)
        self._send(pb.DataFrame(end=pb.DataEnd()))
        self.metrics.rpc_observed("Pull", time.monotonic() - t0)


def start_dataplane(
    state: ShardState, *, bind: str, port: int, token: str, max_payload_bytes: int
) -> DataPlaneServer:
    """Listen on the host of `bind` (HOST:PORT of the gRPC server) at `port` (0: free)."""
    host = bind.rpartition(":")[0]
    return DataPlaneServer(
        state, host=host, port=port, token=token, max_payload_bytes=max_payload_bytes
    ).start()


__all__ = ["DataPlaneServer", "start_dataplane"]
