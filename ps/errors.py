"""Errors the shard logic raises; the servicer maps each to one gRPC status code.

The plain classes in ps/ never import grpc status handling themselves: they raise
these, and ps/server/servicer.py translates (thin servicers, logic testable without a socket).
Every message says what was expected and what to do.
"""

from __future__ import annotations

import grpc


class PSError(Exception):
    """Base class: a request refused with a status code and a metrics reason."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: str = "other"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class InvalidArgument(PSError):
    """Wrong shape, dtype, byte count or a malformed stream."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "bad_shape"


class NotFound(PSError):
    """A slot key this shard does not hold."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "unknown_key"


class FailedPrecondition(PSError):
    """Not initialised, conflicting init, duplicate or late push, wrong round."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "not_initialized"


class Aborted(PSError):
    """A gradient too stale to apply."""

    code = grpc.StatusCode.ABORTED
    reason = "too_stale"


class ResourceExhausted(PSError):
    """A request larger than the shard accepts."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "too_large"


class DeadlineExceeded(PSError):
    """A pull waited longer than its deadline for a round or for the slowest worker."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "deadline"


class Unavailable(PSError):
    """The shard is draining (shutting down)."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "draining"
