"""Sparse rows on the shard's data plane: PullRows (one table, or several at once) and
PushTables in one frame each way.

A recommendation step moves every touched row of every table twice (pulled, then its
gradient pushed); over gRPC the shard spent half of its CPU in the asyncio server moving
those bytes (issue #46). Here the same calls travel as data-plane frames (proto
DataRowsPull, DataRows, DataTablesPull, DataTablesRows, DataRowsPush), their bytes in the
frame's payload or, on the same host, in the connection's shared-memory segment
(ps/shm.py), and are served by the same code as the gRPC calls (ps/server/doors/
row_calls.py): the same checks, the same refusals with the same words, every table
untouched by a refused push. A frame per table costs the shard a socket read and a
send each, with the Python around them: a model whose forward names every table's ids up
front pulls them all in one DataTablesPull.

A frame's payload is read whole before the call is decided, so a refusal is one status
frame and the connection stays usable. Where the bytes are (payload, or segment) is
checked like every other field: a frame naming segment bytes and carrying a payload, a
segment on a connection without one, a place outside the ring, byte counts that do not
add up to what arrived are INVALID_ARGUMENT before any table is read or written.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from psar.ps import framing as fr
from psar.ps import wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.errors import InvalidArgument, PSError, ResourceExhausted
from psar.ps.server.doors import row_calls


def serve_pull(conn: Any, ask: pb.DataRowsPull, plen: int) -> None:
    """A DataRowsPull on `conn` (ps/server/doors/dataplane_conn.py's _Connection): the
    ids are its payload; answered with a DataRows frame, or a status."""
    t0 = time.monotonic()
    conn.server._count("row_pulls")
    try:
        ids = fr.recv_payload(conn.sock, plen, conn.scratch, conn.clock.deadline) if plen else b""
        try:
            if ask.request.ids:
                raise InvalidArgument(
                    "a data-plane rows_pull carries its ids as the frame's payload; leave "
                    "request.ids empty",
                    reason="malformed",
                )
            room = _Room(conn.segment)
            sparse = row_calls.tables_of(conn.state)
            version, rows = row_calls.pull_rows(sparse, ask.request, ids, room.into)
        finally:
            if plen:
                ids.release()
        reply = pb.DataRows(version=version)
        view = room.place(rows, reply)
        _answer(conn, "rows_pull", pb.DataFrame(rows=reply), [view], reply.shm_bytes)
    except PSError as e:
        conn._status(e.code, e.args[0])
    finally:
        conn.metrics.rpc_observed("PullRows", time.monotonic() - t0)


def serve_tables_pull(conn: Any, ask: pb.DataTablesPull, plen: int) -> None:
    """A DataTablesPull on `conn`: several tables' PullRows, their ids the payload side by
    side; answered with one DataTablesRows frame, or the first refusal's status."""
    t0 = time.monotonic()
    conn.server._count("row_pulls")
    try:
        ids = fr.recv_payload(conn.sock, plen, conn.scratch, conn.clock.deadline) if plen else b""
        try:
            _check_tables_pull(ask, plen)
            room = _Room(conn.segment)
            sparse = row_calls.tables_of(conn.state)
            reply, views, at = pb.DataTablesRows(), [], 0
            for req, n in zip(ask.requests, ask.ids_bytes, strict=True):
                version, rows = row_calls.pull_rows(sparse, req, ids[at : at + n], room.into)
                at += n
                views.append(room.place(rows, reply.tables.add(version=version)))
        finally:
            if plen:
                ids.release()
        in_segment = sum(t.shm_bytes for t in reply.tables)
        _answer(conn, "tables_pull", pb.DataFrame(tables_rows=reply), views, in_segment)
    except PSError as e:
        conn._status(e.code, e.args[0])
    finally:
        conn.metrics.rpc_observed("PullRows", time.monotonic() - t0)


def _answer(
    conn: Any, what: str, frame: pb.DataFrame, views: list[memoryview], in_segment: int
) -> None:
    """Send a pull's reply, the rows not in the segment (`views`) as its payload: more
    than one frame of this shard holds is RESOURCE_EXHAUSTED instead (nothing sent)."""
    total = sum(len(v) for v in views)
    if total > conn.server.max_payload_bytes:
        raise ResourceExhausted(
            f"{what}: {total} bytes of rows is more than one frame of this shard holds "
            f"({conn.server.max_payload_bytes}, --max-message-bytes); pull fewer rows per "
            "call"
        )
    conn._send(frame, views)
    conn.metrics.bytes_sent(in_segment + total)


def _check_tables_pull(ask: pb.DataTablesPull, plen: int) -> None:
    """One id byte count per request, adding up to the payload; no ids in a request."""
    k = len(ask.requests)
    if len(ask.ids_bytes) != k:
        raise InvalidArgument(
            f"tables_pull: {k} requests but {len(ask.ids_bytes)} ids_bytes counts; give "
            "one per request",
            reason="malformed",
        )
    if any(r.ids for r in ask.requests):
        raise InvalidArgument(
            "a data-plane tables_pull carries its ids as the frame's payload; leave each "
            "request's ids empty",
            reason="malformed",
        )
    total = sum(ask.ids_bytes)
    if total != plen:
        raise InvalidArgument(
            f"tables_pull: the ids_bytes counts add up to {total} bytes, {plen} arrived",
            reason="malformed",
        )


class _Room:
    """A pull's rows in the connection's segment (ps/shm.py): gathered straight into it
    (fp32, `into`), else copied in after (`place`: fp16/bf16 rows), else, with no
    segment or no room, left for the frame's payload. One room serves every table of a
    call, each table's rows after the previous table's."""

    def __init__(self, segment: Any) -> None:
        self.segment = segment
        self.begun = False
        self.at: int | None = None
        self.tried = False

    def _begin(self) -> None:
        if not self.begun:  # this call's sender: its bytes are numbered from 0
            self.segment.begin()
            self.begun = True

    def into(self, n: int, dim: int) -> torch.Tensor | None:
        """SparseTables.pull's `out`: the room of n fp32 rows of `dim`, or None."""
        if self.segment is None or not n * dim:
            return None
        self._begin()
        self.tried = True
        got = self.segment.reserve(n * dim * 4)
        if got is None:
            return None  # no room: the rows go in the frame
        self.at = got[0]
        return got[1].view(torch.float32).view(n, dim)

    def place(self, rows: torch.Tensor, reply: pb.DataRows) -> memoryview:
        """Say in `reply` where the rows lie; the bytes left for the payload (none when
        they are in the segment). The next table's rows then go after them."""
        at, tried = self.at, self.tried
        self.at, self.tried = None, False
        if at is not None:
            reply.shm_at, reply.shm_bytes = at, rows.numel() * 4
            return memoryview(b"")
        view = wire.as_bytes_view(rows) if rows.numel() else memoryview(b"")
        if self.segment is not None and len(view) and not tried:
            self._begin()
            at = self.segment.put(view)
            if at is not None:
                reply.shm_at, reply.shm_bytes = at, len(view)
                return memoryview(b"")
        return view


def serve_push(conn: Any, push: pb.DataRowsPush, plen: int) -> None:
    """A DataRowsPush on `conn`: every table's row push of one worker's step, its bytes
    in the payload or the segment; answered with a PushTablesReply frame, or a status."""
    t0 = time.monotonic()
    conn.server._count("row_pushes")
    segment, at, n = conn.segment, push.shm_at, push.shm_bytes
    blob: Any = None
    try:
        if n:
            blob = conn.segment_bytes(
                "rows_push", at, n, plen, "a call's bytes are numbered from 0"
            )
        elif plen:
            blob = fr.recv_payload(conn.sock, plen, conn.scratch, conn.clock.deadline)
        else:
            blob = memoryview(b"")
        reply = row_calls.push_tables(row_calls.tables_of(conn.state), _parts(push, blob))
        conn.metrics.bytes_received(len(blob))
        conn._send(pb.DataFrame(rows_pushed=reply))
    except PSError as e:
        conn._status(e.code, e.args[0])
    finally:
        if n and blob is not None:
            segment.consumed(at, n)  # read (or refused): the worker may reuse it
        elif plen and blob is not None:
            blob.release()
        conn.metrics.rpc_observed("PushRows", time.monotonic() - t0)


def _parts(push: pb.DataRowsPush, blob: memoryview) -> list[tuple[pb.PushRowsHeader, Any, Any]]:
    """(header, id bytes, gradient bytes) of each table's push, cut from `blob` by the
    frame's counts (which must add up to it)."""
    k = len(push.request.pushes)
    if len(push.ids_bytes) != k or len(push.data_bytes) != k:
        raise InvalidArgument(
            f"rows_push: {k} pushes but {len(push.ids_bytes)} ids_bytes and "
            f"{len(push.data_bytes)} data_bytes counts; give one of each per push",
            reason="malformed",
        )
    if any(p.ids or p.data for p in push.request.pushes):
        raise InvalidArgument(
            "a data-plane rows_push carries its ids and gradients after the frame; leave "
            "each push's ids and data empty",
            reason="malformed",
        )
    total = sum(push.ids_bytes) + sum(push.data_bytes)
    if total != len(blob):
        raise InvalidArgument(
            f"rows_push: the counts add up to {total} bytes, {len(blob)} arrived",
            reason="malformed",
        )
    out, at = [], 0
    for p, ni, nd in zip(push.request.pushes, push.ids_bytes, push.data_bytes, strict=True):
        out.append((p.header, blob[at : at + ni], blob[at + ni : at + ni + nd]))
        at += ni + nd
    return out
