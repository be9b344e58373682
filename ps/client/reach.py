"""Is anything listening at --servers? Asked once, before a worker's first call.

Without it, a worker pointed at an address where no shard runs waits out gRPC's deadline
(--timeout-s, 60 s) and ends in a DEADLINE_EXCEEDED traceback whose cause (connection
refused) is buried in a warning (issue #45 defect 12). A TCP connect says it at once: a
refused connection is retried for a few seconds (a shard started beside the worker may
still be binding its port), then the worker stops with one line naming the address and
the flag. A connect that times out (a firewall, a host still booting) is left to the calls
themselves: slow is not the same as absent.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence

LISTEN_WAIT_S = 10.0
"""How long a refused address is retried before the worker gives up on it."""


class NothingListens(ConnectionRefusedError):
    """Every try to connect to a --servers address was refused."""


def split_address(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def wait_until_listening(
    addresses: Sequence[str],
    *,
    within_s: float = LISTEN_WAIT_S,
    connect: Callable[[tuple[str, int], float], socket.socket] = socket.create_connection,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Return once every address accepts a TCP connection (or did not answer at all);
    raise NothingListens naming the first address that refused for `within_s`."""
    deadline = clock() + within_s
    for address in addresses:
        host, port = split_address(address)
        while True:
            try:
                connect((host, port), min(2.0, within_s)).close()
                break
            except ConnectionRefusedError:
                if clock() >= deadline:
                    raise NothingListens(
                        f"nothing listens at {address} (--servers): connection refused for "
                        f"{within_s:g} s; start its shard (psar server --bind {address}) or "
                        "fix the address"
                    ) from None
                sleep(0.25)
            except OSError:
                break  # a timeout or an unreachable route: the calls' own deadlines judge
