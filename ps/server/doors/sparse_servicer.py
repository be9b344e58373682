"""gRPC edge of the sparse tables (CreateTables, PullRows, PushRows, PushTables): proto in,
the calls both doors serve (ps/server/doors/row_calls.py), proto out; PSError -> status
code. Bad input is refused before anything is applied (INVALID_ARGUMENT naming the table
and the ids). The data plane serves PullRows and PushTables too
(ps/server/doors/dataplane_rows.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc

from psar.ps import serde, wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.errors import InvalidArgument, PSError, bound_details
from psar.ps.server.doors import row_calls
from psar.ps.server.doors.servicer import ParameterServerServicer, decoded, require_clean_end
from psar.ps.server.shard import ShardState
from psar.ps.server.sparse.tables import SparseTables


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
            version, rows = row_calls.pull_rows(self.sparse, request, request.ids)
        except PSError as e:
            context.abort(e.code, bound_details(e.args[0]))
            return
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
            row_calls.check_header(h)
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
            push = row_calls.row_push(self.sparse, h, bytes(ids_b), bytes(data_b), owned=True)
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
            parts = [(p.header, p.ids, p.data) for p in request.pushes]
            reply = row_calls.push_tables(self.sparse, parts, owned=True)
            self.metrics.bytes_received(sum(len(x.ids) + len(x.data) for x in request.pushes))
            return reply
        except PSError as e:
            context.abort(e.code, bound_details(e.args[0]))
        finally:
            self.metrics.rpc_observed("PushRows", time.monotonic() - t0)
