"""The validation of a push's header and data pieces.

Split out of ps/server/shard.py: these checks need no shard lock (only the slot sizes), and
each raises a psar.ps.errors exception before any byte lands in the master weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from psar.ps import wire
from psar.ps.errors import InvalidArgument, NotFound, quote
from psar.ps.headers import PushHeader, StepOptions
from psar.ps.server.intake.scratch import ExactStaging
from psar.ps.server.modes.exact_sum import ExactSum
from psar.trainkit.finite import all_finite, all_finite_readonly


@dataclass
class PushTicket:
    """An in-flight push: its header, where its bytes go, and how much has arrived."""

    header: PushHeader
    staging: MutableMapping[str, torch.Tensor]
    received: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    duplicate: bool = False
    lock: threading.Lock | None = None
    incarnation: int = 0
    """The shard's incarnation when the push began (a rollback in between refuses it)."""
    verdict: bool | None = None
    """verdict_follows pushes: the overflow verdict once it arrived (None: not yet)."""
    unscaled: dict[str, bool] = field(default_factory=dict)
    """Slots already unscaled as they completed (while later ones still stream): whether
    each is finite. finish_push unscales only the rest."""
    accepted: bool = False
    """The push went to the update policy; releasing it then drops nothing."""
    raw: frozenset[str] = frozenset()
    """Slots holding values, not gradients (model buffers): never unscaled."""
    absent: frozenset[str] = frozenset()
    """Slots the worker had no gradient for (its header's, then its verdict's list):
    their data counts as zeros, and a slot absent from every push of a round is not
    stepped (DDP's find_unused_parameters semantics, docs/architecture.md)."""
    paced_s: float = 0.0
    """Seconds the shard held this push back to keep it in step (ps/server/intake/pacing.py)."""
    options: StepOptions | None = None
    """A streamed push's step options, from its verdict (None: the header's)."""
    on_drop: Callable[[PushTicket], None] | None = None
    """Called on release of a push that was never accepted (refused, cut off, or a
    duplicate), before its worker may push again (per-chunk rounds undo with it)."""
    exact: ExactSum | None = None
    """The round's exact sum this fp16 push's slots are added to as each arrives whole
    (its staging is then an ExactStaging: ps/server/intake/scratch.py); None: staged."""
    asked: bool = False
    """The update rule's exact_sum was asked about this push (a data push, not a
    duplicate): the first such push of a sync round decides how the round sums, and
    takes that back if it ends unaccepted (UpdatePolicy.push_not_accepted)."""

    @property
    def overflow(self) -> bool:
        """Whether this push is (so far) an overflow: by its header or by its verdict."""
        return self.header.overflow or bool(self.verdict)

    def release(self) -> None:
        if self.lock is not None:
            try:
                if not self.accepted and self.on_drop is not None:
                    self.on_drop(self)  # an exact sum subtracts it (from its scratch)
            finally:
                if isinstance(self.staging, ExactStaging):
                    self.staging.close()  # its scratch buffers go back to the pool
                self.lock.release()
                self.lock = None


def check_header(header: PushHeader, num_workers: int) -> None:
    """Refuse a header that no shard state could accept."""
    if not 0 <= header.worker < num_workers:
        raise InvalidArgument(
            f"worker {header.worker} is not in this job (workers 0..{num_workers - 1})",
            reason="bad_worker",
        )
    if header.dtype not in wire.WIRE_FROM_DTYPE:
        raise InvalidArgument(
            f"unsupported gradient dtype {header.dtype}; send fp32, fp16 or bf16",
            reason="bad_dtype",
        )
    if header.verdict_follows and header.overflow:
        raise InvalidArgument(
            "a push with verdict_follows must not set overflow in its header: send the "
            "overflow in its PushVerdict",
            reason="malformed",
        )
    if not (header.loss_scale > 0 and header.loss_scale < float("inf")):
        raise InvalidArgument(
            f"loss_scale must be a finite number > 0, got {header.loss_scale}",
            reason="malformed",
        )


def check_piece(
    numel: dict[str, int], ticket: PushTicket, key: str, offset: int, nbytes: int
) -> int:
    """Validate one piece of a push from its description; count it; returns its elements."""
    n_slot = numel.get(key)
    if n_slot is None:
        raise NotFound(f"unknown slot key {quote(key)}: this shard holds {_some(numel)}")
    if ticket.header.overflow:
        raise InvalidArgument("a push flagged overflow must carry no data", reason="malformed")
    if ticket.verdict:
        raise InvalidArgument(
            "after an overflow verdict no more data may follow: stop the stream there",
            reason="malformed",
        )
    itemsize = wire.DTYPE_ITEMSIZE[ticket.header.dtype]
    if nbytes % itemsize:
        raise InvalidArgument(
            f"slot {quote(key)}: {nbytes} bytes is not a whole number of {itemsize}-byte elements",
        )
    n = nbytes // itemsize
    expected = ticket.received.get(key, 0)
    if offset != expected:
        raise InvalidArgument(
            f"slot {quote(key)}: piece at offset {offset}, expected {expected} (send each "
            f"slot's pieces once, in order)",
        )
    if offset + n > n_slot:
        raise InvalidArgument(
            f"slot {quote(key)}: {offset + n} elements sent but it holds {n_slot} (wrong shape)",
        )
    ticket.received[key] = offset + n
    ticket.bytes_in += nbytes
    return n


def add_piece(
    numel: dict[str, int], ticket: PushTicket, key: str, offset: int, data: bytes
) -> None:
    """Validate one piece of a push and copy it into the ticket's staging buffers."""
    n = check_piece(numel, ticket, key, offset, len(data))
    if not ticket.duplicate and n:
        ticket.staging[key][offset : offset + n].copy_(wire.decode(data, ticket.header.dtype))


def add_piece_streamed(
    numel: dict[str, int],
    ticket: PushTicket,
    key: str,
    offset: int,
    nbytes: int,
    read_into: Callable[[memoryview], None],
    read: Callable[[int], Any],
) -> None:
    """add_piece for bytes still in a socket (the TCP data plane): validated from the
    piece's description first (a refusal reads nothing), then an fp32 piece is read
    straight into the staging buffer, other dtypes are read and converted."""
    n = check_piece(numel, ticket, key, offset, nbytes)
    if ticket.duplicate or not n:
        read(nbytes)  # drained and dropped
        return
    dst = ticket.staging[key][offset : offset + n]
    if ticket.header.dtype == dst.dtype:
        read_into(wire.as_bytes_view(dst))
    else:
        dst.copy_(wire.decode(read(nbytes), ticket.header.dtype))


def check_absent(numel: dict[str, int], keys: tuple[str, ...] | list[str]) -> frozenset[str]:
    """The slots a push says carry no gradient: each must be one of this shard's."""
    for k in keys:
        if k not in numel:
            raise NotFound(
                f"absent slot {quote(k)} is not on this shard (it holds {_some(numel)}); "
                "list only this shard's slots as absent"
            )
    return frozenset(keys)


def zero_absent(ticket: PushTicket) -> None:
    """The slots the worker had no gradient for count as zeros, whatever bytes came for
    them (DDP sums a zero-filled bucket for a rank that did not use a parameter)."""
    for k in ticket.absent:
        ticket.staging[k].zero_()
        ticket.unscaled[k] = True


def add_verdict(ticket: PushTicket, overflow: bool, absent: frozenset[str] = frozenset()) -> None:
    """Record a push's finiteness verdict (once, and only where its header announced it)."""
    if not ticket.header.verdict_follows:
        raise InvalidArgument(
            "a verdict in a push whose header did not set verdict_follows", reason="malformed"
        )
    if ticket.verdict is not None:
        raise InvalidArgument("a push carries one verdict only", reason="malformed")
    ticket.verdict = overflow
    ticket.absent = ticket.absent | absent


def check_complete(numel: dict[str, int], ticket: PushTicket) -> None:
    if ticket.header.verdict_follows and ticket.verdict is None:
        raise InvalidArgument(
            "incomplete push: the header said a verdict follows, but the stream ended "
            "without one; send a PushVerdict after the data",
        )
    short = [k for k, n in numel.items() if ticket.received.get(k, 0) != n]
    if short:
        k = short[0]
        raise InvalidArgument(
            f"incomplete push: slot {quote(k)} got {ticket.received.get(k, 0)} of "
            f"{numel[k]} elements ({len(short)} slots short)",
        )


def slot_complete(numel: dict[str, int], ticket: PushTicket, key: str) -> bool:
    """Has the last piece of slot `key` of this (data-carrying) push just arrived?"""
    return not ticket.duplicate and ticket.received.get(key, 0) == numel[key] > 0


def add_exact(ticket: PushTicket, key: str) -> None:
    """A complete slot of a push into an exact round: checked finite, then added to the
    round's sum (a slot the header named absent counts as zeros, whatever came). Its
    scratch stays with the push until it ends (a push not accepted is subtracted again
    from it). `unscaled` records whether it was finite."""
    exact, h = ticket.exact, ticket.header
    assert exact is not None
    if key in ticket.raw:  # a buffer's value: kept in the worker's staging for the close
        ticket.unscaled[key] = True
        return
    if key in ticket.absent:
        exact.add_zeros(h.worker, h.clock, key)
        ticket.unscaled[key] = True
        return
    values = ticket.staging[key]
    finite = all_finite_readonly([values])
    if finite:
        exact.add(h.worker, h.clock, key, values)
    # Only now: a per-chunk round applies a slot early once every worker's is marked
    # finite, and must find each of them in the sum (another worker's slot may complete
    # on another thread between the check and the add).
    ticket.unscaled[key] = finite


def unscale_slot(ticket: PushTicket, key: str) -> None:
    """Unscale one complete slot in place (once) and record whether it is finite."""
    if key not in ticket.unscaled:
        if key in ticket.raw:  # a buffer's value: the loss scale never touched it
            ticket.unscaled[key] = True
            return
        ticket.unscaled[key] = unscale({key: ticket.staging[key]}, ticket.header.loss_scale)


def unscale_rest(ticket: PushTicket) -> bool:
    """Unscale the slots not unscaled yet; returns whether the whole push is finite.
    Per slot or all at once, it is the same multiplication per element: same bits."""
    rest = {
        k: t for k, t in ticket.staging.items() if k not in ticket.unscaled and k not in ticket.raw
    }
    finite = unscale(rest, ticket.header.loss_scale)
    return finite and all(ticket.unscaled.values())


def unscale(grads: dict[str, torch.Tensor], loss_scale: float) -> bool:
    """Divide the loss scale out in place; returns whether every value is finite."""
    tensors = list(grads.values())
    if loss_scale != 1.0 and tensors:
        # Unscale first, then check: values that overflow only once the scale is divided
        # out (a scale < 1) must count as non-finite too.
        torch._foreach_mul_(tensors, 1.0 / loss_scale)
    return all_finite(tensors)


def _some(keys: dict[str, int]) -> str:
    names = list(keys)
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return ", ".join(quote(k) for k in names[:3]) + more
