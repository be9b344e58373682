"""gRPC edge of the sparse tables (CreateTables, PullRows, PushRows, PushTables): proto in,
SparseTables call (ps/server/sparse/tables.py), proto out; PSError -> status code. Bad input
is refused before anything is applied (INVALID_ARGUMENT naming the table and the ids)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import grpc
import torch

from psar.ps import serde, wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.errors import InvalidArgument, PSError, bound_details, quote
from psar.ps.server.doors.servicer import ParameterServerServicer, decoded, require_clean_end
from psar.ps.server.shard import ShardState
from psar.ps.server.sparse.tables import RowPush, SparseTables


def decode_ids(data: bytes) -> torch.Tensor:
    if len(data) % 8:
        raise InvalidArgument(f"ids: {len(data)} bytes is not a whole number of int64")
    return (
        torch.frombuffer(bytearray(data), dtype=torch.int64)
        if data
        else torch.empty(0, dtype=torch.int64)
    )


class SparseServicer(ParameterServerServicer):
    """The dense servicer plus the sparse-table RPCs (tables created lazily)."""

    def __init__(self, state: ShardState) -> None:
        super().__init__(state)
        if state.sparse is None:
            state.sparse = SparseTables(state)
        self.sparse: SparseTables = state.sparse

    def CreateTables(self, request: pb.CreateTablesRequest, context: grpc.ServicerContext) -> Any:
        try:
            specs = [serde.spec_from_pb(t) for t in request.tables]
            already = self.sparse.create(specs)
            return pb.CreateTablesReply(already_created=already, table_bytes=self.sparse.nbytes)
        except PSError as e:
            context.abort(e.code, bound_details(e.args[0]))

    def PullRows(self, request: pb.PullRowsRequest, context: grpc.ServicerContext) -> Iterator[Any]:
        t0 = time.monotonic()
        try:
            dtype = serde.dtype_from_pb(request.dtype)
            version, rows = self.sparse.pull(request.worker, request.table, decode_ids(request.ids))
        except PSError as e:
            context.abort(e.code, bound_details(e.args[0]))
            return
        rows = rows.to(dtype).reshape(-1) if dtype != torch.float32 else rows.reshape(-1)
        dim = max(1, self.sparse.tables[request.table].spec.dim)
        per = max(1, self.state.message_bytes // (dim * rows.element_size())) * dim
        sent = 0
        if rows.numel() == 0:
            yield pb.PullRowsChunk(version=version)
        for off, data in wire.iter_pieces(rows, per * rows.element_size()):
            sent += len(data)
            yield pb.PullRowsChunk(version=version, offset=off // dim, data=data)
        self.metrics.bytes_sent(sent)
        self.metrics.rpc_observed("PullRows", time.monotonic() - t0)

    def PushRows(self, request_iterator: Iterator[pb.PushRowsChunk], context: Any) -> Any:
        t0 = time.monotonic()
        try:
            request_iterator = decoded(request_iterator, "PushRows")
            first = next(request_iterator, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise InvalidArgument(
                    "PushRows stream must start with a header", reason="malformed"
                )
            h = first.header
            _check_header(h)
            ids_b, data_b = bytearray(), bytearray()
            for msg in request_iterator:
                kind = msg.WhichOneof("kind")
                if kind == "ids" and not data_b:
                    ids_b += msg.ids
                elif kind == "data":
                    data_b += msg.data
                else:
                    raise InvalidArgument("PushRows: one header, then ids, then data")
            require_clean_end(context, "PushRows")
            self.metrics.bytes_received(len(ids_b) + len(data_b))
            push = self._row_push(h, bytes(ids_b), bytes(data_b))
            applied, already, version, stale = self.sparse.push(h.table, push)
            return pb.PushRowsReply(
                applied=applied, already_applied=already, version=version, staleness=stale
            )
        except PSError as e:
            context.abort(e.code, bound_details(e.args[0]))
        finally:
            self.metrics.rpc_observed("PushRows", time.monotonic() - t0)

    def PushTables(self, request: pb.PushTablesRequest, context: grpc.ServicerContext) -> Any:
        """Every table's PushRows of one worker's step in one message: all of them are
        checked before any table changes, then pushed in request order."""
        t0 = time.monotonic()
        try:
            pushes = []
            for part in request.pushes:
                _check_header(part.header)
                pushes.append((part.header.table, self._row_push(part.header, part.ids, part.data)))
            names = [n for n, _ in pushes]
            if len(set(names)) != len(names):
                raise InvalidArgument(f"PushTables: a table named twice in {quote(names)}")
            if len({p.worker for _, p in pushes}) > 1:
                raise InvalidArgument("PushTables: pushes of one worker only")
            self.metrics.bytes_received(sum(len(x.ids) + len(x.data) for x in request.pushes))
            replies = [
                pb.PushRowsReply(applied=a, already_applied=al, version=v, staleness=st)
                for a, al, v, st in self.sparse.push_many(pushes)
            ]
            return pb.PushTablesReply(replies=replies)
        except PSError as e:
            context.abort(e.code, bound_details(e.args[0]))
        finally:
            self.metrics.rpc_observed("PushRows", time.monotonic() - t0)

    def _row_push(self, h: pb.PushRowsHeader, ids_b: bytes, data_b: bytes) -> RowPush:
        """A RowPush from a checked header and its whole id and gradient bytes."""
        dtype = serde.dtype_from_pb(h.dtype)
        ids = decode_ids(ids_b)
        if ids.numel() != h.num_ids:
            raise InvalidArgument(
                f"PushRows table {quote(h.table)}: header says {h.num_ids} ids, got {ids.numel()}"
            )
        item = wire.DTYPE_ITEMSIZE[dtype]
        if len(data_b) % item:
            raise InvalidArgument(f"PushRows table {quote(h.table)}: ragged gradient bytes")
        grads = wire.decode(data_b, dtype).float() if data_b else torch.empty(0)
        n = ids.numel()
        if n and grads.numel() % n == 0:
            grads = grads.reshape(n, -1)
        elif n or grads.numel():
            grads = grads.reshape(1, -1)  # refused by the width check
        else:
            grads = grads.reshape(0, self.sparse.table(h.table).spec.dim)
        if h.loss_scale not in (0.0, 1.0):
            grads = grads / h.loss_scale
        return RowPush(h.worker, h.clock, h.base_version, h.overflow, ids, grads)


def _check_header(h: pb.PushRowsHeader) -> None:
    serde.dtype_from_pb(h.dtype)
    serde.check_count("PushRows clock", h.clock)
    serde.check_count("PushRows base_version", h.base_version)
    if not (math.isfinite(h.loss_scale) and h.loss_scale >= 0):
        raise InvalidArgument(
            f"PushRows table {quote(h.table)}: loss_scale must be a finite number "
            f">= 0 (0: not scaled), got {h.loss_scale}",
            reason="malformed",
        )
