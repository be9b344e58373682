"""Errors the shard logic raises; the servicer maps each to one gRPC status code.

The plain classes in ps/ never import grpc status handling themselves: they raise
these, and ps/server/doors/servicer.py translates (thin servicers, logic testable without a socket).
Every message says what was expected and what to do.
"""

from __future__ import annotations

import grpc

QUOTE_CHARS = 200
"""A client-supplied value (a key, a table name, ids) is quoted in an error message up to
this many characters: the message travels in a gRPC trailer (a header, ~8-16 KiB at most
before gRPC answers RESOURCE_EXHAUSTED instead of our code) or a data-plane status frame."""
MAX_DETAILS_CHARS = 4096
"""Final bound on every status message at the gRPC and data-plane edges (bound_details)."""


def quote(value: object, limit: int = QUOTE_CHARS) -> str:
    """repr(value), cut to `limit` characters with an ellipsis and the original length, so
    an error naming a huge client-supplied value stays small."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} chars)"


def bound_details(details: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """A status message cut to `limit` characters (a last guard for messages that quote
    something unbounded without quote())."""
    if len(details) <= limit:
        return details
    return f"{details[:limit]}... (message cut from {len(details)} chars)"


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


class Cancelled(PSError):
    """The caller went away while its request waited (an early pull whose worker hung up)."""

    code = grpc.StatusCode.CANCELLED
    reason = "cancelled"


class Unavailable(PSError):
    """The shard is draining (shutting down)."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "draining"
