"""Whether a shard runs on this host: what `--early-pull` auto decides by.

An early pull sends a round's slots back while the worker's push still streams, so the
link carries both directions at once; on one host there is no link to share, and the
extra wake-ups and copies cost CPU the workers need (docs/results.md, 2026-12-01: early pulls). A
host is this one when its address is a loopback address or one this machine can bind.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable


def is_this_host(host: str) -> bool:
    """True when `host` (a name or an address) resolves to this machine."""
    host = host.strip("[]")
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except socket.gaierror:
        return False  # not resolvable here: certainly not a name of this host's
    for family, _, _, _, addr in infos:
        ip = addr[0]
        if ipaddress.ip_address(ip.split("%")[0]).is_loopback:
            return True
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((ip, 0))  # only an address of one of this host's interfaces binds
                return True
            except OSError:
                continue
    return False


def any_remote(addresses: Iterable[str]) -> bool:
    """Whether some HOST:PORT of `addresses` is on another host."""
    return any(not is_this_host(a.rpartition(":")[0]) for a in addresses)


def resolve_early_pull(
    setting: bool | None, *, eligible: bool, data_plane: str, addresses: Iterable[str]
) -> bool:
    """--early-pull as rank 0 proposes it for the job: forced on/off, or (None) on where
    it can be (`eligible`: a mode in rounds, no sparse tables, not local SGD) and pays:
    tensors may take the data plane and some shard is on another host."""
    if setting is not None:
        return setting and eligible
    return eligible and data_plane != "grpc" and any_remote(addresses)
