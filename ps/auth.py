"""Who may talk to a shard: TLS (mutual with a CA) and a shared bearer token.

- TLS: the shard serves with --tls-cert/--tls-key; with --tls-ca it also demands a
  client certificate signed by that CA (mutual TLS). Workers give the CA that signed
  the shard's certificate (--tls-ca) and, for mutual TLS, their own --tls-cert/--tls-key.
- Token: with --auth-token-file the shard refuses every call whose metadata lacks
  `authorization: Bearer <token>` with UNAUTHENTICATED, and counts it in
  psar_ps_pushes_rejected_total{reason="unauthenticated"}. The standard health service
  stays open (Kubernetes probes carry no token).

The token travels in call metadata, so use it together with TLS off a trusted network.
"""

from __future__ import annotations

import collections
import hmac
from pathlib import Path
from typing import Any

import grpc

HEADER = "authorization"
HEALTH_PREFIX = "/grpc.health.v1.Health/"


def read_token(path: str) -> str:
    """The token in a file (surrounding whitespace stripped); refuses an empty one."""
    try:
        token = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"--auth-token-file {path}: {e.strerror or e}") from None
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"--auth-token-file {path}: the token must be one non-empty word")
    return token


def read_bytes(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None


def server_credentials(cert: str, key: str, ca: str = "") -> grpc.ServerCredentials:
    """TLS for a shard; with `ca`, clients must present a certificate it signed."""
    if not cert or not key:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    pair = (read_bytes(key, "--tls-key"), read_bytes(cert, "--tls-cert"))
    root = read_bytes(ca, "--tls-ca") if ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=root, require_client_auth=bool(ca))


def channel_credentials(ca: str = "", cert: str = "", key: str = "") -> grpc.ChannelCredentials:
    """TLS for a worker: trust `ca` (system roots without one); present cert/key if given."""
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both --tls-cert and --tls-key")
    return grpc.ssl_channel_credentials(
        root_certificates=read_bytes(ca, "--tls-ca") if ca else None,
        private_key=read_bytes(key, "--tls-key") if key else None,
        certificate_chain=read_bytes(cert, "--tls-cert") if cert else None,
    )


def make_channel(
    address: str,
    options: list[tuple[str, Any]],
    *,
    tls_ca: str = "",
    tls_cert: str = "",
    tls_key: str = "",
    tls_server_name: str = "",
    token: str = "",
) -> grpc.Channel:
    """A channel to one shard: TLS when any TLS file is given, the token on every call."""
    if tls_ca or tls_cert or tls_key:
        opts = list(options)
        if tls_server_name:
            opts.append(("grpc.ssl_target_name_override", tls_server_name))
        channel = grpc.secure_channel(
            address, channel_credentials(tls_ca, tls_cert, tls_key), options=opts
        )
    else:
        channel = grpc.insecure_channel(address, options=options)
    if token:
        channel = grpc.intercept_channel(channel, TokenClientInterceptor(token))
    return channel


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    pass


class TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds `authorization: Bearer <token>` to every call."""

    def __init__(self, token: str) -> None:
        self._md = (HEADER, f"Bearer {token}")

    def _details(self, d: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        md = [*(d.metadata or ()), self._md]
        return _CallDetails(
            d.method,
            d.timeout,
            md,
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # noqa: ANN001, ANN201
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, requests):  # noqa: ANN001, ANN201
        return continuation(self._details(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):  # noqa: ANN001, ANN201
        return continuation(self._details(details), requests)


class TokenServerInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without the right bearer token (UNAUTHENTICATED), and counts them.
    For the shard's grpc.aio server (ps/server/doors/aio_host.py); the refusal is a coroutine,
    so a refused call never takes a handler thread."""

    def __init__(self, token: str, metrics: Any = None) -> None:
        self._want = f"Bearer {token}".encode()
        self._metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):  # noqa: ANN001, ANN201
        method = handler_call_details.method or ""
        if method.startswith(HEALTH_PREFIX):
            return await continuation(handler_call_details)
        got = ""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == HEADER:
                got = value if isinstance(value, str) else value.decode("latin-1")
        if hmac.compare_digest(got.encode(), self._want):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        if self._metrics is not None:
            self._metrics.push_rejected("unauthenticated")
        why = "missing" if not got else "wrong"
        return _refusing(handler, f"unauthenticated: {why} bearer token for {method}")


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts with UNAUTHENTICATED."""

    # A coroutine serves every kind: grpc.aio awaits it (for streaming replies as the
    # reader/writer style handler), on the loop, without a thread.
    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse, **kw)
    return grpc.unary_unary_rpc_method_handler(refuse, **kw)
