"""ClientConfig: how a worker's client talks to the shards.

The connection fields (timeouts, reconnect, TLS, data plane) are not declared here: they
are inherited from psar.trainkit.connection.ConnectionConfig, the same class `psar train`'s
[ps] section (trainkit/config.py PSConfig) inherits, so both have one default and one check
each. `ClientConfig.of(cfg.ps, auth_token=...)` builds the client's config from a train
config; tests and benchmarks still construct ClientConfig directly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass
from typing import Any

from psar.ps import wire
from psar.ps.client.tcp_transport import DEFAULT_MAX_FRAME_BYTES
from psar.ps.grpc_limits import DEFAULT_MAX_MESSAGE_BYTES
from psar.trainkit.connection import ConnectionConfig


@dataclass(kw_only=True)
class ClientConfig(ConnectionConfig):
    """How a worker talks to the shards (the connection fields are ConnectionConfig's)."""

    message_bytes: int = wire.DEFAULT_MESSAGE_BYTES
    """Bytes of tensor data per streamed gRPC message."""
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    """Largest message sent or accepted."""
    auth_token: str = ""
    """Bearer token sent with every call (empty: none)."""
    data_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Data plane: tensor bytes per pushed frame (at most the shard's max message bytes)."""
    retry_timeout_s: InitVar[float | None] = None
    """The former name of reconnect_timeout_s, still accepted by the constructor so
    callers written against it keep working (read reconnect_timeout_s: there is one
    setting and one default)."""

    def __post_init__(self, retry_timeout_s: float | None) -> None:  # type: ignore[override]
        if retry_timeout_s is not None:
            self.reconnect_timeout_s = retry_timeout_s
        super().__post_init__()

    @classmethod
    def of(cls, conn: ConnectionConfig, **client_only: Any) -> ClientConfig:
        """The client config of a train config's [ps] section (any ConnectionConfig):
        every connection field as it is there, plus the client-only ones given."""
        shared = {f.name: getattr(conn, f.name) for f in dataclasses.fields(ConnectionConfig)}
        return cls(**shared, **client_only)
