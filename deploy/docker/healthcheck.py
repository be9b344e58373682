#!/usr/bin/env python3
"""Container health probe for psar images (Docker HEALTHCHECK).

    psar-healthcheck [HOST:PORT]

A shard (`psar server`) is healthy when its gRPC port answers: the standard gRPC health
service (grpc.health.v1.Health/Check) says SERVING, or, on a server that has no health
service, the call reaches the server and comes back UNIMPLEMENTED (the port is up and
speaks HTTP/2). Without HOST:PORT the probe finds the `psar server` process in /proc and
uses its --bind port on 127.0.0.1. A container that runs no shard (a worker) is healthy
while it runs: exit 0. Exit 1 means unhealthy, with one line on stderr saying why.

Only grpcio is needed (a psar dependency); no grpc_health package, no shell tools.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
SERVING = 1
DEFAULT_BIND = "127.0.0.1:50051"
_ANY = ("0.0.0.0", "::", "[::]", "")


def _is_psar_server(argv: Sequence[str]) -> bool:
    for i, tok in enumerate(argv[:-1]):
        name = os.path.basename(tok)
        if (name == "psar" or tok == "psar.worker.cli") and argv[i + 1] == "server":
            return True
    return False


def _bind_of(argv: Sequence[str]) -> str:
    for i, tok in enumerate(argv):
        if tok == "--bind" and i + 1 < len(argv):
            return argv[i + 1]
        if tok.startswith("--bind="):
            return tok.split("=", 1)[1]
    return DEFAULT_BIND


def find_target(proc_root: str = "/proc") -> str | None:
    """127.0.0.1:PORT of the `psar server` in this container, or None if none runs."""
    for entry in sorted(Path(proc_root).glob("[0-9]*"), key=lambda p: int(p.name)):
        try:
            raw = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in raw.split(b"\0") if a]
        if _is_psar_server(argv):
            host, _, port = _bind_of(argv).rpartition(":")
            return f"{'127.0.0.1' if host in _ANY else host}:{port}"
    return None


def _status_of(reply: bytes) -> int:
    """HealthCheckResponse.status (field 1, varint); absent means UNKNOWN (0)."""
    if len(reply) >= 2 and reply[0] == 0x08:
        return reply[1]
    return 0


def check(target: str, timeout: float = 3.0) -> tuple[bool, str]:
    """(healthy, why) for the gRPC server at target."""
    import grpc

    with grpc.insecure_channel(target) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            return False, f"{target}: no gRPC server answers within {timeout:g}s"
        call = channel.unary_unary(HEALTH_CHECK)  # raw bytes in and out
        try:
            reply = call(b"", timeout=timeout)  # empty HealthCheckRequest: the whole server
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                return True, f"{target}: up (no health service)"
            return False, f"{target}: health check failed: {e.code().name}"
    status = _status_of(reply)
    if status == SERVING:
        return True, f"{target}: SERVING"
    return False, f"{target}: health status {status} (not SERVING)"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    target = args[0] if args else find_target()
    if target is None:
        return 0  # no shard in this container (a worker): healthy while it runs
    ok, why = check(target)
    print(why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
