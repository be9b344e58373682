"""PSClient's choice of transport per shard (mixin; ps/client/transport.py has the contract).

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
from psar.ps.client.grpc_transport import GrpcTransport
from psar.ps.client.tcp_transport import DataPlaneClient, client_ssl_context
from psar.ps.client.transport import Transport, TransportError
from psar.trainkit.connection import DATA_PLANES, check_data_plane

T = TypeVar("T")

__all__ = ["DATA_PLANES", "DataPlaneCalls", "check_data_plane"]


class DataPlaneCalls:
    """Needs PSClient's cfg, addresses, _stubs, _grpc, _data, _data_ports, _data_stale."""

    cfg: Any
    addresses: list[str]
    _stubs: list[Any]
    _grpc: list[GrpcTransport]
    _data: list[DataPlaneClient | None]
    _data_ports: list[int]
    _data_stale: list[bool]

    def _transport(self, shard: int) -> Transport:
        """The shard's data plane where it applies (TLS too), else its gRPC transport."""
        if self.cfg.data_plane == "grpc":
            return self._grpc[shard]
        if self._data_stale[shard]:  # a restarted shard may listen on another data port
            reply = self._stubs[shard].GetJob(pb.GetJobRequest(), timeout=self.cfg.timeout_s)
            self._use_data_port(shard, reply.data_port)
        return self._data[shard] or self._grpc[shard]

    def _use_data_port(self, shard: int, port: int) -> None:
        self._data_stale[shard] = False
        if self.cfg.data_plane == "grpc":
            return
        if not port and self.cfg.data_plane == "tcp":
            raise PSClientError(
                shard,
                self.addresses[shard],
                None,
                "--data-plane tcp, but this shard serves no data plane (started with "
                "--data-port -1); use --data-plane auto or grpc",
            )
        old = self._data[shard]
        if old is not None and old.port == port:
            return
        self._data[shard] = None
        if old is not None:
            old.close()
        if port:
            host = self.addresses[shard].rpartition(":")[0]
            self._data[shard] = DataPlaneClient(
                host,
                port,
                token=self.cfg.auth_token,
                connect_timeout_s=self.cfg.timeout_s,
                max_frame_bytes=self.cfg.data_frame_bytes,
                ssl_context=self._data_tls(),
                server_name=self.cfg.tls_server_name,
                shm_bytes=int(self.cfg.data_shm_mib * (1 << 20)),
            )
        self._data_ports[shard] = port

    def shards_in_shared_memory(self) -> bool:
        """Does every shard take this worker's bytes through shared memory (it is on this
        host, ps/shm.py)? Then they move as memory copies on this host's cores, no link
        between (ps/client/host_cpu.py asks). Over gRPC no data-plane client is made."""
        return all(d is not None and d.in_shared_memory() for d in self._data)

    def _data_tls(self) -> Any:
        """The TLS context of the data plane (one, shared by every shard), None without TLS."""
        if not self.cfg.tls:
            return None
        ctx = getattr(self, "_data_ssl", None)
        if ctx is None:
            c = self.cfg
            ctx = self._data_ssl = client_ssl_context(c.tls_ca, c.tls_cert, c.tls_key)
        return ctx

    def _via(self, shard: int, call: Callable[[Transport], T]) -> T:
        """Run call on the shard's transport; a data-plane connection failure marks its
        port for re-discovery (GetJob) before the caller's retry."""
        t = self._transport(shard)
        try:
            return call(t)
        except TransportError as e:
            if isinstance(t, DataPlaneClient) and e.code() == grpc.StatusCode.UNAVAILABLE:
                self._data_stale[shard] = True
            raise
