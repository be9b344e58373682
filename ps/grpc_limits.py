"""gRPC channel and server options both ends use: message size limits and keepalive."""

from __future__ import annotations

# A piece is ~1 MiB plus a small header; allow some slack and refuse anything bigger
# with RESOURCE_EXHAUSTED (gRPC enforces it before our code sees the message).
DEFAULT_MAX_MESSAGE_BYTES = 16 << 20


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """Channel/server options used on both ends: explicit sizes and keepalive."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]
