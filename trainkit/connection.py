"""How a worker reaches the shards: deadlines, reconnection, TLS and the data plane.

Declared once, here, because two configs need the same fields: `psar train`'s [ps]
section (trainkit/config.py PSConfig, whose flags --timeout-s, --reconnect-timeout-s,
--tls-* and --data-plane are generated from these fields and docstrings) and the
worker's client (ps/client/client_config.py ClientConfig). Both inherit this class, so
a default or a check changes in one place. It lives in trainkit, not in ps/client,
because trainkit/config.py is imported by the DDP side too, which must not load ps
(tests/test_walls.py).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

DATA_PLANES = ("auto", "tcp", "grpc")


def check_data_plane(data_plane: str, tls: bool) -> None:
    """Refuse (ValueError naming the flag) an unknown --data-plane. (`tls` is kept for
    callers: under TLS the data plane is TLS too, so every choice is allowed.)"""
    del tls
    if data_plane not in DATA_PLANES:
        raise ValueError(
            f"--data-plane: unknown {data_plane!r}; accepted: {', '.join(DATA_PLANES)}"
        )


@dataclass(kw_only=True)
class ConnectionConfig:
    """Deadlines, reconnection, TLS and the data plane of a worker's calls to the shards."""

    timeout_s: float = 60.0
    """Deadline of calls that never wait on other workers (init, push), and how long a
    worker of rank > 0 waits for rank 0 to initialise the shards (it says so every few
    seconds, then exits non-zero naming rank 0)."""
    pull_timeout_s: float = 300.0
    """Deadline of a pull, which may wait for a sync round or the slowest SSP worker."""
    data_plane: str = "auto"
    """Where tensor bytes travel: tcp (the shards' TCP data plane; TLS when --tls-* is
    given), grpc, or auto (tcp where the shard offers it, else grpc). Control stays on
    gRPC."""
    data_shm_mib: float = 8.0
    """Data plane to a shard on this host, without TLS: a shared-memory ring of this
    many MiB per connection (a sealed memfd, ps/shm.py) carries the tensor bytes instead of
    the socket, one copy on each end (docs/dataplane.md, "Shared memory"). The receiver
    frees it as it reads, so a model of any size goes through it; a piece finding no room
    goes in the socket. 0: off."""
    # -- faults and security (docs/reliability.md) --
    reconnect_timeout_s: float = 120.0
    """Keep retrying an unreachable shard (restarting, --restore) for this long."""
    tls_ca: str = ""
    """TLS to the shards: PEM CA that signed their certificates."""
    tls_cert: str = ""
    """Mutual TLS: this worker's PEM certificate."""
    tls_key: str = ""
    """Mutual TLS: this worker's PEM private key."""
    tls_server_name: str = ""
    """Expect this name in the shards' certificates instead of the --servers host."""

    def __post_init__(self) -> None:
        if not (self.timeout_s > 0 and self.pull_timeout_s > 0):
            raise ValueError("--timeout-s and --pull-timeout-s must be > 0")
        check_data_plane(self.data_plane, self.tls)
        if not 0 <= self.data_shm_mib <= 2048:
            raise ValueError(
                f"--data-shm-mib must be in [0, 2048] (0: no shared memory), got "
                f"{self.data_shm_mib}"
            )

    @property
    def tls(self) -> bool:
        """TLS is on when any --tls-* file is given."""
        return bool(self.tls_ca or self.tls_cert or self.tls_key)


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP address, `[v6]`, or `localhost`) reaches this host only.
    0.0.0.0 and :: (every interface) and any other name are not: a name is not resolved
    here (it may name any interface, and --dry-run needs no DNS)."""
    host = host.strip().removeprefix("[").removesuffix("]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
