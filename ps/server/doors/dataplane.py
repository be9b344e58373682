"""The shard's data plane: push and pull over plain TCP frames, next to gRPC.

Python gRPC tops out at ~1.4-2 GB/s on loopback here (protobuf copies, 1 MiB messages
through the C core); these frames (ps/framing.py, proto/psar/v1/ps.proto) carry the
same push and pull with one copy on each end. It is a second door to the SAME shard:
pushes and pulls are decoded and validated by PushCall and start_pull
(ps/server/doors/calls.py), as the servicer's are, which leave every decision to the
shard's intake and pulls, so errors get the status codes and messages gRPC gives, and the
same metrics are counted. gRPC keeps
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
connection is TLS from its first byte to its last (standard TLS records, the default);
the token is checked in the hello as before. Only with `seal_records` (psar server
--data-sealed-records, an opt-in: docs/sealed-records.md) does a worker that asks in its
hello (seal_share) get the rest of the connection in psar's sealed records (ps/sealed.py).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
import time

import grpc

from psar.ps import framing as fr
from psar.ps import sealed
from psar.ps.server.doors.dataplane_conn import _Connection
from psar.ps.server.shard import ShardState

log = logging.getLogger("psar.dataplane")

DEFAULT_IDLE_S = 300.0
"""Close a data-plane connection with no frame for this long (psar server --data-idle-s)."""
DEFAULT_FRAME_S = 30.0
"""A frame (16 MiB at most) must arrive within this long of its first byte."""
DEFAULT_MAX_CONNS_PER_PEER = 256
"""Connections one peer address may hold (psar server --data-max-conns-per-peer)."""


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
        seal_records: bool = False,
        shm: bool = True,
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
        self.seal_records = seal_records and ssl_context is not None and sealed.available()
        """Under TLS, agree to carry a connection in sealed records after its hello when
        the worker asks (ps/sealed.py; opt-in, --data-sealed-records); else, the default,
        standard TLS records throughout."""
        self.shm = shm
        """Attach to a worker's shared-memory segment when it offers one (same host, no
        TLS; ps/shm.py): its tensor bytes then skip the socket (psar server --no-data-shm)."""
        self._per_peer: dict[str, int] = {}
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
        """conn starts a push of `worker`: cut off the push of it still streaming, on
        this door or gRPC (ps/server/intake/takeover.py), so that one is released unapplied
        and this one need not wait for its worker lock."""
        self.state.intake.in_flight.supersede(worker, conn, "data plane")

    def _push_began(self, worker: int, conn: _Connection) -> None:
        """conn's push of `worker` was accepted (it holds the worker's push lock)."""

        def cut_off() -> None:  # from the superseding push's thread
            self._count("superseded")
            conn.superseded = True
            fr.hard_shutdown(conn.sock)  # its thread wakes from recv and lets go

        self.state.intake.in_flight.began(worker, conn, "data plane", cut_off)

    def _push_ended(self, worker: int, conn: _Connection) -> None:
        self.state.intake.in_flight.ended(worker, conn)

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
                if conn.sock is not sock:  # sealed after the hello: the descriptor moved
                    conn.sock.close()
            with self._lock:
                self._conns.discard(raw)
                self._conns.discard(sock)
                if conn is not None:
                    self._conns.discard(conn.sock)
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
        self._rehome(sock, tls)
        return tls

    def _rehome(self, old: socket.socket, new: socket.socket) -> None:
        with self._lock:  # close() must shut the socket that owns the descriptor now
            self._conns.discard(old)
            self._conns.add(new)


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
    seal_records: bool = False,
    shm: bool = True,
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
        seal_records=seal_records,
        shm=shm,
    ).start()


STAT_KEYS = ("accepted", "sealed", "shm", "shm_refused", "buffered_bytes", "peak_buffered_bytes", "pushes", "pulls",
             "row_pulls", "row_pushes", "superseded", "idle_closed", "deadline_closed",
             "refused_peer_cap")  # fmt: skip

__all__ = ["DataPlaneServer", "server_ssl_context", "start_dataplane"]
