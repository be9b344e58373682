"""The standard gRPC health service (grpc.health.v1) on every shard, for Kubernetes probes.

Status, for the whole server ("") and for "psar.v1.ParameterServer":
- SERVING as soon as the shard listens: it must accept rank 0's Init to become useful,
  so "initialised" cannot be the readiness condition. (GetJob says whether it is.)
- NOT_SERVING once SIGTERM arrives and the shard drains: probes and load balancers
  stop sending it new work while it finishes the round in flight and checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

if TYPE_CHECKING:
    from psar.ps.server.doors.aio_host import ShardServer

SERVICE = "psar.v1.ParameterServer"


class ShardHealth:
    """The health service of a shard's grpc.aio server (ps/server/doors/aio_host.py): its asyncio
    servicer, so a Watch parks on the loop instead of holding a handler thread; status
    changes are made on that loop from whichever thread asks."""

    def __init__(self, server: ShardServer) -> None:
        self._server = server
        self.servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    def _set(self, status: int) -> None:
        async def set_all() -> None:
            for name in ("", SERVICE):
                await self.servicer.set(name, status)

        self._server.run(set_all())

    def serving(self) -> None:
        self._set(health_pb2.HealthCheckResponse.SERVING)

    def not_serving(self) -> None:
        self._set(health_pb2.HealthCheckResponse.NOT_SERVING)

    def shutdown(self) -> None:
        """Final state: NOT_SERVING, and watchers are told no more changes will come."""
        self._server.run(self.servicer.enter_graceful_shutdown())


def check(channel: grpc.Channel, service: str = "", timeout: float = 5.0) -> str:
    """The status name (SERVING, NOT_SERVING, ...) a shard reports for `service`."""
    stub = health_pb2_grpc.HealthStub(channel)
    reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
