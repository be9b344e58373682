"""PSClient's choice of transport per shard (a part of it; ps/client/transport.py has the contract).

Tensor bytes travel over the shard's TCP data plane (ps/client/tcp_transport.py)
where it offers one (its GetJob reply names the port), else over gRPC
(ps/client/grpc_transport.py); both run the same push and pull logic. Under TLS the data
plane is TLS too, with the worker's --tls-* files and --tls-server-name, and carries the
same token. Control calls always use gRPC. A shard that restarts may listen on another data port: a failed
connection marks the port stale and the next attempt asks GetJob again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.errors import PSClientError
from psar.ps.client.tcp_transport import DataPlaneClient, client_ssl_context
from psar.ps.client.transport import Transport, TransportError
from psar.trainkit.connection import DATA_PLANES, check_data_plane

T = TypeVar("T")

__all__ = ["DATA_PLANES", "DataPlaneCalls", "check_data_plane"]


class DataPlaneCalls:
    """A part of PSClient: which door (TCP data plane or gRPC) carries each shard's bytes; the client holds the per-shard transports and ports."""

    def __init__(self, client: Any) -> None:
        self.c = client
        """The PSClient this part serves: its stubs, retries and per-shard state."""

    def transport(self, shard: int) -> Transport:
        """The shard's data plane where it applies (TLS too), else its gRPC transport."""
        if self.c.cfg.data_plane == "grpc":
            return self.c._grpc[shard]
        if self.c._data_stale[shard]:  # a restarted shard may listen on another data port
            reply = self.c._stubs[shard].GetJob(pb.GetJobRequest(), timeout=self.c.cfg.timeout_s)
            self.use_data_port(shard, reply.data_port)
        return self.c._data[shard] or self.c._grpc[shard]

    def use_data_port(self, shard: int, port: int) -> None:
        self.c._data_stale[shard] = False
        if self.c.cfg.data_plane == "grpc":
            return
        if not port and self.c.cfg.data_plane == "tcp":
            raise PSClientError(
                shard,
                self.c.addresses[shard],
                None,
                "--data-plane tcp, but this shard serves no data plane (started with "
                "--data-port -1); use --data-plane auto or grpc",
            )
        old = self.c._data[shard]
        if old is not None and old.port == port:
            return
        self.c._data[shard] = None
        if old is not None:
            old.close()
        if port:
            host = self.c.addresses[shard].rpartition(":")[0]
            self.c._data[shard] = DataPlaneClient(
                host,
                port,
                token=self.c.cfg.auth_token,
                connect_timeout_s=self.c.cfg.timeout_s,
                max_frame_bytes=self.c.cfg.data_frame_bytes,
                ssl_context=self.tls(),
                server_name=self.c.cfg.tls_server_name,
                shm_bytes=int(self.c.cfg.data_shm_mib * (1 << 20)),
            )
        self.c._data_ports[shard] = port

    def shards_in_shared_memory(self) -> bool:
        """Does every shard take this worker's bytes through shared memory (it is on this
        host, ps/shm.py)? Then they move as memory copies on this host's cores, no link
        between (ps/client/host_cpu.py asks). Over gRPC no data-plane client is made."""
        return all(d is not None and d.in_shared_memory() for d in self.c._data)

    def tls(self) -> Any:
        """The TLS context of the data plane (one, shared by every shard), None without TLS."""
        if not self.c.cfg.tls:
            return None
        ctx = getattr(self, "_data_ssl", None)
        if ctx is None:
            c = self.c.cfg
            ctx = self.c._data_ssl = client_ssl_context(c.tls_ca, c.tls_cert, c.tls_key)
        return ctx

    def via(self, shard: int, call: Callable[[Transport], T]) -> T:
        """Run call on the shard's transport; a data-plane connection failure marks its
        port for re-discovery (GetJob) before the caller's retry."""
        t = self.transport(shard)
        try:
            return call(t)
        except TransportError as e:
            if isinstance(t, DataPlaneClient) and e.code() == grpc.StatusCode.UNAVAILABLE:
                self.c._data_stale[shard] = True
            raise
