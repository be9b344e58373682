"""PSClient's choice of data plane per shard (mixin; ps/server/dataplane.py has the server).

Tensor bytes travel over the shard's plain-TCP data plane where it offers one (its
GetJob reply names the port) and TLS is off, else over gRPC; control calls always use
gRPC. A shard that restarts may listen on another data port: a failed connection marks
the port stale and the next attempt asks GetJob again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from ps._gen.psar.v1 import ps_pb2 as pb
from ps.client.tcp_transport import DataPlaneClient, DataPlaneError

T = TypeVar("T")

DATA_PLANES = ("auto", "tcp", "grpc")


def check_data_plane(data_plane: str, tls: bool) -> None:
    """Refuse (ValueError naming the flag) an unknown --data-plane, or tcp with TLS on."""
    if data_plane not in DATA_PLANES:
        raise ValueError(
            f"--data-plane: unknown {data_plane!r}; accepted: {', '.join(DATA_PLANES)}"
        )
    if data_plane == "tcp" and tls:
        raise ValueError(
            "--data-plane tcp sends tensors in plaintext, but TLS is on (--tls-*): use "
            "--data-plane grpc (or auto) so tensors travel over TLS"
        )


class DataPlaneCalls:
    """Needs PSClient's cfg, addresses, _stubs, _data, _data_ports, _data_stale."""

    cfg: Any
    addresses: list[str]
    _stubs: list[Any]
    _data: list[DataPlaneClient | None]
    _data_ports: list[int]
    _data_stale: list[bool]

    def _data_plane(self, shard: int) -> DataPlaneClient | None:
        """The shard's TCP data-plane client, or None to move tensors over gRPC."""
        if self.cfg.data_plane == "grpc" or self.cfg.tls:
            return None
        if self._data_stale[shard]:  # a restarted shard may listen on another data port
            reply = self._stubs[shard].GetJob(pb.GetJobRequest(), timeout=self.cfg.timeout_s)
            self._use_data_port(shard, reply.data_port)
        return self._data[shard]

    def _use_data_port(self, shard: int, port: int) -> None:
        self._data_stale[shard] = False
        if self.cfg.data_plane == "grpc" or self.cfg.tls:
            return
        if not port and self.cfg.data_plane == "tcp":
            from ps.client.errors import PSClientError

            raise PSClientError(
                shard,
                self.addresses[shard],
                None,
                "--data-plane tcp, but this shard serves no data plane (started with "
                "--data-port -1 or with TLS); use --data-plane auto or grpc",
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
            )
        self._data_ports[shard] = port

    def _via_data_plane(self, shard: int, call: Callable[[DataPlaneClient], T]) -> T:
        """Run call on the shard's data plane; a connection failure marks its port for
        re-discovery (GetJob) before the caller's retry."""
        dp = self._data_plane(shard)
        assert dp is not None
        try:
            return call(dp)
        except DataPlaneError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self._data_stale[shard] = True
            raise
