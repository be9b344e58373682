"""A push and a pull as both doors decode them (the gRPC servicer and the TCP data plane):
`PushCall` takes a push's header, pieces and verdict into the shard's intake, `start_pull`
(and its early and parked forms) asks the shard's pulls and encodes the header. Each door
reads its own messages or frames and calls these, so both refuse the same things with the
same words (ps/errors.py's PSError, which each door maps to its status)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from typing import Any, NoReturn

import torch

from psar.ps import serde
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.errors import InvalidArgument
from psar.ps.server.pulls.parking import in_pool
from psar.ps.server.shard import ShardState


class PushCall:
    """One push as either door receives it: a header, then pieces and at most one
    verdict in any order, then its end. Each door reads its own messages or frames and
    calls these; a refusal raises the PSError both doors answer with."""

    def __init__(self, state: ShardState, head: pb.PushHeader) -> None:
        self.intake = state.intake
        self.ticket: Any = self.intake.begin_push(
            serde.push_header_from_pb(head), incarnation=head.incarnation
        )

    def piece(
        self,
        key: str,
        offset: int,
        nbytes: int,
        read_into: Callable[[memoryview], None],
        read: Callable[[int], Any],
    ) -> None:
        """One piece: checked from its description (slot, offset, length) before a byte
        is read, then read straight into the staging buffer (or converted)."""
        self.intake.add_data_from(self.ticket, key, offset, nbytes, read_into, read)

    def piece_bytes(self, key: str, offset: int, data: bytes) -> None:
        """A piece whose bytes are in hand (a gRPC message): the same path as piece()."""

        def read_into(view: memoryview) -> None:
            view[:] = data

        self.piece(key, offset, len(data), read_into, lambda _n: data)

    def verdict(self, msg: pb.PushVerdict) -> None:
        options = serde.options_from_pb(msg.options) if msg.HasField("options") else None
        self.intake.add_verdict(self.ticket, msg.overflow, tuple(msg.absent), options)

    def misplaced(self, kind: str | None) -> NoReturn:
        raise InvalidArgument(
            f"Push: a {kind or 'empty'} message inside a push; only one header allowed, "
            "then pieces, one verdict and the end",
            reason="malformed",
        )

    def finish(self) -> pb.PushReply:
        """Hand the complete push to the shard (which releases the ticket either way)."""
        ticket, self.ticket = self.ticket, None
        incarnation = ticket.incarnation
        outcome, version, already = self.intake.finish_push(ticket)
        return serde.push_reply_to_pb(outcome, version, already, incarnation)

    def release(self) -> None:
        """Drop a push that will not finish (refused, or its stream broke)."""
        if self.ticket is not None:
            self.ticket.release()
            self.ticket = None


def _pull_args(req: pb.PullRequest, timeout: float | None) -> tuple[torch.dtype, int, float]:
    """A pull request's dtype, clock and how long it may wait, checked."""
    dtype = serde.dtype_from_pb(req.dtype)
    clock = serde.check_count("pull clock", req.clock)
    # None (no deadline) or a huge one waits at most MAX_WAIT_S (Condition.wait overflows).
    wait = serde.wait_seconds("pull timeout", serde.MAX_WAIT_S if timeout is None else timeout)
    return dtype, clock, wait


def _release_held(state: ShardState, req: pb.PullRequest) -> None:
    """A pull that brings its round's total squared norm (clipping in rounds) applies the
    round's held update first (ps/server/update/clipping.py)."""
    if req.HasField("clip_total_sq"):
        clock = serde.check_count("pull clock", req.clock)
        state.pulls.release_held(clock, req.clip_total_sq, incarnation=req.incarnation)


def round_norm_args(req: pb.RoundNormRequest, timeout: float | None) -> tuple[int, float]:
    clock = serde.check_count("round clock", req.clock)
    wait = serde.wait_seconds("RoundNorm timeout", serde.MAX_WAIT_S if timeout is None else timeout)
    return clock, wait


def _pull_head(state: ShardState, header: Any) -> pb.PullHeader:
    head = serde.pull_header_to_pb(header)
    head.incarnation = state.incarnation
    return head


def start_pull(
    state: ShardState, req: pb.PullRequest, timeout: float | None, *, views: bool = False
) -> tuple[pb.PullHeader, list[tuple[str, int, Any]]]:
    """A pull as either door serves it: wait as the mode requires, then the header (with
    the incarnation it was served at) and the pieces (key, offset, bytes) to send. This
    one holds the calling thread while it waits; the gRPC door uses start_pull_parked."""
    dtype, clock, wait = _pull_args(req, timeout)
    _release_held(state, req)
    header, pieces = state.pulls.pull(
        req.worker, clock, dtype, wait, incarnation=req.incarnation, views=views
    )
    return _pull_head(state, header), pieces


def start_pull_early(
    state: ShardState,
    req: pb.PullRequest,
    timeout: float | None,
    *,
    views: bool = False,
    alive: Callable[[], bool] = lambda: True,
) -> Iterator[tuple[Any, ...]]:
    """An early pull (req.early; ps/server/pulls/early.py) as the data plane serves it:
    ("piece", key, offset, bytes) items, then ("header", pb.PullHeader) with early_void
    set, then the rest. Refusals raise at the first next(), before anything is sent."""
    dtype, clock, wait = _pull_args(req, timeout)
    _release_held(state, req)
    items = state.pulls.pull_early(
        req.worker, clock, dtype, wait, incarnation=req.incarnation, views=views, alive=alive
    )
    for item in items:
        if item[0] == "header":
            head = _pull_head(state, item[1])
            head.early_void = item[2]
            yield ("header", head)
        else:
            yield item


async def start_pull_parked(
    state: ShardState, req: pb.PullRequest, timeout: float | None, executor: Executor | None
) -> tuple[pb.PullHeader, list[tuple[str, int, Any]]]:
    """start_pull on the event loop: a pull that has to wait holds no thread meanwhile."""
    dtype, clock, wait = _pull_args(req, timeout)
    await in_pool(executor, _release_held, state, req)  # it may step: off the event loop
    header, pieces = await state.pulls.pull_parked(
        req.worker,
        clock,
        dtype,
        wait,
        incarnation=req.incarnation,
        executor=executor,
        early=req.early,  # answered whole once the push is in: gRPC does not stream early
    )
    return _pull_head(state, header), pieces
