"""The sparse-table calls both doors serve: PullRows and PushTables from bytes to replies.

The gRPC servicer (ps/server/doors/sparse_servicer.py) and the data plane
(ps/server/doors/dataplane_rows.py) hand these functions the request's header and its
id and gradient bytes, whichever way they arrived (a protobuf field, a frame's payload,
a shared-memory segment), so both doors refuse the same things with the same words and
count the same metrics. Everything is checked before any table changes (SparseTables.
push_many); a refusal is a PSError the door turns into its status.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from psar.ps import serde, wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.errors import FailedPrecondition, InvalidArgument, quote
from psar.ps.server.sparse.tables import RowPush, SparseTables


def decode_ids(data: Any) -> torch.Tensor:
    """int64 ids from bytes (copied: the caller's buffer may be reused)."""
    if len(data) % 8:
        raise InvalidArgument(f"ids: {len(data)} bytes is not a whole number of int64")
    return (
        torch.frombuffer(bytearray(data), dtype=torch.int64)
        if len(data)
        else torch.empty(0, dtype=torch.int64)
    )


def tables_of(state: Any) -> SparseTables:
    """The shard's sparse tables (FAILED_PRECONDITION where it serves none)."""
    sparse = getattr(state, "sparse", None)
    if sparse is None:
        raise FailedPrecondition(
            "this shard serves no sparse tables (it was started without them); "
            "start it with `psar server`, which serves them"
        )
    return sparse


def pull_rows(
    sparse: SparseTables,
    req: pb.PullRowsRequest,
    ids: Any,
    out: Callable[[int, int], torch.Tensor | None] | None = None,
) -> tuple[int, torch.Tensor]:
    """(the table's version here, the rows of `ids` (bytes) as one flat tensor of the
    request's dtype, in the ids' order). `out(rows, dim)` (fp32 requests only) may give
    the tensor to gather them into (SparseTables.pull)."""
    dtype = serde.dtype_from_pb(req.dtype)
    into = out if dtype == torch.float32 else None
    version, rows = sparse.pull(req.worker, req.table, decode_ids(ids), into)
    return version, (rows.to(dtype) if dtype != torch.float32 else rows).reshape(-1)


def check_header(h: pb.PushRowsHeader) -> None:
    """A push header's numbers: dtype known, counts in range, loss scale finite >= 0."""
    serde.dtype_from_pb(h.dtype)
    serde.check_count("PushRows clock", h.clock)
    serde.check_count("PushRows base_version", h.base_version)
    if not (math.isfinite(h.loss_scale) and h.loss_scale >= 0):
        raise InvalidArgument(
            f"PushRows table {quote(h.table)}: loss_scale must be a finite number "
            f">= 0 (0: not scaled), got {h.loss_scale}",
            reason="malformed",
        )


def row_push(
    sparse: SparseTables, h: pb.PushRowsHeader, ids_b: Any, data_b: Any, *, owned: bool = False
) -> RowPush:
    """A RowPush from a checked header and its whole id and gradient bytes. `owned`: the
    bytes stay as they are while the push is held (a protobuf field); else (a frame's
    buffer, a segment: reused after the call) the gradient is copied out of them."""
    dtype = serde.dtype_from_pb(h.dtype)
    ids = decode_ids(ids_b)
    if ids.numel() != h.num_ids:
        raise InvalidArgument(
            f"PushRows table {quote(h.table)}: header says {h.num_ids} ids, got {ids.numel()}"
        )
    item = wire.DTYPE_ITEMSIZE[dtype]
    if len(data_b) % item:
        raise InvalidArgument(f"PushRows table {quote(h.table)}: ragged gradient bytes")
    grads = wire.decode(data_b, dtype).float() if len(data_b) else torch.empty(0)
    scaled = h.loss_scale not in (0.0, 1.0)
    if not owned and dtype == torch.float32 and not scaled and grads.numel():
        grads = grads.clone()  # .float() and the division below copy already
    n = ids.numel()
    if n and grads.numel() % n == 0:
        grads = grads.reshape(n, -1)
    elif n or grads.numel():
        grads = grads.reshape(1, -1)  # refused by the width check
    else:
        grads = grads.reshape(0, sparse.table(h.table).spec.dim)
    if scaled:
        grads = grads / h.loss_scale
    return RowPush(h.worker, h.clock, h.base_version, h.overflow, ids, grads)


def push_tables(
    sparse: SparseTables,
    parts: Sequence[tuple[pb.PushRowsHeader, Any, Any]],
    *,
    owned: bool = False,
) -> pb.PushTablesReply:
    """Every table's row push of one worker's step (header, id bytes, gradient bytes;
    `owned` as in row_push): all are checked before any table changes, then pushed in
    order."""
    pushes = []
    for h, ids_b, data_b in parts:
        check_header(h)
        pushes.append((h.table, row_push(sparse, h, ids_b, data_b, owned=owned)))
    names = [n for n, _ in pushes]
    if len(set(names)) != len(names):
        raise InvalidArgument(f"PushTables: a table named twice in {quote(names)}")
    if len({p.worker for _, p in pushes}) > 1:
        raise InvalidArgument("PushTables: pushes of one worker only")
    return pb.PushTablesReply(
        replies=[
            pb.PushRowsReply(applied=a, already_applied=al, version=v, staleness=st)
            for a, al, v, st in sparse.push_many(pushes)
        ]
    )
