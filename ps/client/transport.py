"""The transport contract: a worker's push and pull, written once for both doors.

Tensor bytes reach a shard through its gRPC stream (ps/client/grpc_transport.py) or its
plain-TCP data plane (ps/client/tcp_transport.py). Each implements the four primitives of
`Transport` (send a push's parts, open a pull, cancel, close); everything above them is
here, so the two cannot drift apart (tests/test_transport_contract.py runs the same
cases over both against a real shard):

- push: the items, ("data", key, offset, tensor) or ("verdict", overflow) as
  ps/client/overlap.py makes them, are checked (a known kind; a contiguous CPU tensor of
  the header's dtype) and cut into pieces of at most `piece_bytes`, each a memoryview of
  the caller's tensor (a transport that must own its bytes copies them).
- pull: the header comes first (its dtype must be one the wire knows; then on_header),
  then each piece is checked against the caller's buffers (a key of `out`, whole
  elements, offset + n within the slot) before any byte of it lands; it lands straight
  in the destination where dtypes match (else converted on copy); then on_piece.

Errors are TransportError, a grpc.RpcError with .code() and .details() like gRPC's own,
so one retry policy (PSClient._retrying) serves both: a shard's refusal keeps its code
and details; what does not fit the contract is INTERNAL.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import torch

from psar.ps import serde, wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb

Item = tuple[Any, ...]
"""A push item: ("data", key, offset, tensor) or ("verdict", overflow[, absent keys[,
step options (psar.ps.headers.StepOptions)]])."""


class TransportError(grpc.RpcError):
    """A failed push or pull, shaped like a grpc.RpcError (code(), details())."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass(frozen=True, slots=True)
class Piece:
    """One outgoing piece: `data` (a byte view of the caller's tensor) lands in slot
    `key` at element `offset`."""

    key: str
    offset: int
    data: memoryview


@dataclass(frozen=True, slots=True)
class Verdict:
    """A push's finiteness verdict (its header announced it with verdict_follows)."""

    overflow: bool
    absent: tuple[str, ...] = ()
    """Slots of this shard with no gradient this step (their data was zeros)."""
    options: pb.StepOptions | None = None
    """The step's options (a worker's own loop: learning rates, clipping), if any."""

    def to_pb(self) -> pb.PushVerdict:
        return pb.PushVerdict(overflow=self.overflow, absent=self.absent, options=self.options)


class Incoming(Protocol):
    """A received pull piece whose `nbytes` bytes have not been read yet."""

    key: str
    offset: int
    nbytes: int

    def read_into(self, view: memoryview) -> None:
        """Read the bytes into `view` (exactly nbytes long)."""

    def read(self) -> bytes | memoryview:
        """Read the bytes into a buffer of the transport's (valid until the next read)."""


class PullStream(ABC):
    """One pull in flight: header(), then next_piece() until None; close() always."""

    @abstractmethod
    def header(self) -> pb.PullHeader:
        """The shard's first answer (a refusal raises its status instead)."""

    @abstractmethod
    def next_piece(self) -> Incoming | None:
        """The next piece, or None at the end of the pull."""

    @abstractmethod
    def next_early(self) -> Incoming | pb.PullHeader:
        """An early pull's next message: a piece sent before the header, or the header
        (a refusal raises its status instead)."""

    @abstractmethod
    def cancel(self) -> None:
        """Abort this pull from another thread: it raises CANCELLED."""

    @abstractmethod
    def close(self) -> None:
        """Release the call (a pull that did not reach its end is abandoned)."""


class Transport(ABC):
    """One shard's door for tensor bytes. Subclasses give the primitives; push() and
    pull() are the contract, the same for every door."""

    address: str
    """HOST:PORT, named in errors."""

    @property
    @abstractmethod
    def piece_bytes(self) -> int:
        """Tensor bytes per pushed piece (at most)."""

    @abstractmethod
    def send_push(
        self, header: pb.PushHeader, parts: Iterator[Piece | Verdict], *, timeout_s: float
    ) -> pb.PushReply:
        """Send the header, then each part as it comes (the iterator may block between
        parts, and raises what push_parts raises), then end; the shard's reply."""

    @abstractmethod
    def open_pull(self, req: pb.PullRequest, *, timeout_s: float) -> PullStream:
        """Ask for a pull (the shard may wait, up to timeout_s, before its header)."""

    @abstractmethod
    def cancel_all(self) -> None:
        """Abort every pull in flight (from another thread): they raise CANCELLED."""

    @abstractmethod
    def close(self) -> None:
        """Release what the transport holds; pulls in flight are aborted."""

    # ---- the contract ---------------------------------------------------------------

    def push(self, header: pb.PushHeader, items: Iterable[Item], *, timeout_s: float) -> Any:
        """Stream one push (header, then each item as it comes); the shard's PushReply."""
        parts = push_parts(header.dtype, items, self.piece_bytes)
        return self.send_push(header, parts, timeout_s=timeout_s)

    def pull(
        self,
        req: pb.PullRequest,
        out: dict[str, torch.Tensor],
        *,
        timeout_s: float,
        on_header: Callable[[pb.PullHeader], None] | None = None,
        on_piece: Callable[[str, int, int], None] | None = None,
        on_open: Callable[[PullStream], None] | None = None,
    ) -> Any:
        """Pull the shard's weights into `out` (flat tensors keyed by slot; any float
        dtype, converted on copy). on_open(stream) runs once the call is open (to cancel
        it from elsewhere), on_header(header) before the data, on_piece(key, offset, n)
        after each piece has landed. Returns the PullHeader.

        An early pull (req.early): pieces may come before the header. They land in `out`
        at once, but on_piece runs for them only once the header says they hold (not
        early_void), just before on_header: the caller lets nothing of them into its
        parameters before then (ps/server/pulls/early.py)."""
        stream = self.open_pull(req, timeout_s=timeout_s)
        try:
            if on_open is not None:
                on_open(stream)
            early: list[tuple[str, int, int]] = []
            header = self._early_pieces(stream, out, req.dtype, early) if req.early else None
            if header is None:
                header = stream.header()
            dtype = wire.DTYPE_FROM_WIRE.get(header.dtype)
            if dtype is None or (early and header.dtype != req.dtype):
                raise TransportError(
                    grpc.StatusCode.INTERNAL, f"pull from {self.address}: dtype {header.dtype}"
                )
            if on_piece is not None and not header.early_void:
                for landed in early:
                    on_piece(*landed)
            if on_header is not None:
                on_header(header)  # before the data: the round closed (ps/client/overlap.py)
            itemsize = wire.DTYPE_ITEMSIZE[dtype]
            while (piece := stream.next_piece()) is not None:
                target = fit(out, piece, itemsize, self.address)
                land(piece, target, dtype)
                if on_piece is not None:
                    on_piece(piece.key, piece.offset, target.numel())
            return header
        finally:
            stream.close()

    def _early_pieces(
        self,
        stream: PullStream,
        out: dict[str, torch.Tensor],
        wire_dtype: int,
        landed: list[tuple[str, int, int]],
    ) -> pb.PullHeader:
        """Land the pieces an early pull sends before its header (in the dtype asked
        for), noting each in `landed`; returns the header."""
        dtype = wire.DTYPE_FROM_WIRE.get(wire_dtype)
        if dtype is None:
            raise TransportError(
                grpc.StatusCode.INVALID_ARGUMENT, f"pull from {self.address}: dtype {wire_dtype}"
            )
        itemsize = wire.DTYPE_ITEMSIZE[dtype]
        while not isinstance(msg := stream.next_early(), pb.PullHeader):
            target = fit(out, msg, itemsize, self.address)
            land(msg, target, dtype)
            landed.append((msg.key, msg.offset, target.numel()))
        return msg


def push_parts(
    wire_dtype: int, items: Iterable[Item], piece_bytes: int
) -> Iterator[Piece | Verdict]:
    """The parts of a push: each data item's tensor cut into byte views of at most
    `piece_bytes` (whole elements), each verdict as it is; a bad item raises ValueError."""
    want = wire.DTYPE_FROM_WIRE.get(wire_dtype)
    # An unknown header dtype: the shard refuses the header (its message says which).
    itemsize = 1 if want is None else wire.DTYPE_ITEMSIZE[want]
    per = max(1, piece_bytes // itemsize) * itemsize
    for item in items:
        if item[0] == "data":
            _, key, offset, t = item
            view = tensor_bytes(t, want)
            for start in range(0, len(view), per):
                yield Piece(key, offset + start // itemsize, view[start : start + per])
        elif item[0] == "verdict":
            absent = tuple(item[2]) if len(item) > 2 else ()
            options = item[3] if len(item) > 3 and item[3] is not None else None
            yield Verdict(bool(item[1]), absent, _options_pb(options))
        else:
            raise ValueError(f"push item must be ('data', ...) or ('verdict', ...): {item[0]!r}")


def _options_pb(options: Any) -> pb.StepOptions | None:
    return serde.options_to_pb(options) if options is not None and options.given else None


def tensor_bytes(t: torch.Tensor, want: torch.dtype | None) -> memoryview:
    """The bytes of a pushed tensor, without a copy: it must be the header's dtype, on
    the CPU and contiguous (a wrong dtype would send bytes the shard misreads)."""
    if t.dtype != want or t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(
            f"push data must be contiguous CPU tensors of the header's dtype {want}; got "
            f"{t.dtype} on {t.device} (contiguous: {t.is_contiguous()})"
        )
    return wire.as_bytes_view(t.reshape(-1))


def fit(out: dict[str, torch.Tensor], piece: Incoming, itemsize: int, address: str) -> torch.Tensor:
    """Where a received piece lands: checked BEFORE any byte is read, so a shard (or a
    bug) can never write outside the caller's buffers."""
    dest = out.get(piece.key)
    n = piece.nbytes // itemsize
    why = ""
    if dest is None:
        why = "no destination buffer has that key"
    elif piece.nbytes % itemsize:
        why = f"not a whole number of {itemsize}-byte elements"
    elif piece.offset + n > dest.numel():
        why = f"it ends at {piece.offset + n}, past the slot's {dest.numel()} elements"
    if why:
        raise TransportError(
            grpc.StatusCode.INTERNAL,
            f"pull from {address}: piece {piece.key!r} at {piece.offset} of {piece.nbytes} "
            f"bytes does not fit the destination buffers ({why})",
        )
    assert dest is not None
    return dest[piece.offset : piece.offset + n]


def land(piece: Incoming, target: torch.Tensor, dtype: torch.dtype) -> None:
    """Read a piece into `target`: straight into its memory where the dtype matches and
    it is a contiguous CPU tensor, else through the transport's buffer, converted."""
    if target.dtype == dtype and target.device.type == "cpu" and target.is_contiguous():
        piece.read_into(wire.as_bytes_view(target))
        return
    raw = piece.read()
    target.copy_(wire.decode(raw, dtype))
    if isinstance(raw, memoryview):
        raw.release()  # a view of the transport's scratch buffer: let it be replaced
