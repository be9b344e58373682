"""Sparse rows over one shard's data plane (the worker's end of
ps/server/doors/dataplane_rows.py): a PullRows (one table, or several: pull_tables) or a
PushTables in one frame each way.

The ids of a pull go in the frame's payload (small); its rows come back in the
connection's shared-memory segment where the shard attached one (same host), else in
the reply's payload. A push's ids and gradients go in the segment where they fit, else
in the payload. Errors are the data plane's (DataPlaneError: code() and details() like
gRPC's), so PSClient's retries treat both doors alike.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from psar.ps import framing as fr
from psar.ps import shm, wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.tcp_transport import SC, DataPlaneClient, DataPlaneError
from psar.ps.client.transport import Transport

T = TypeVar("T")


class UseGrpc(Exception):
    """This call cannot go on the shard's data plane, and nothing of it was sent: the
    connection it got cannot carry its bytes (more than a frame of them, and no segment
    with room for them: the shard is on another host, or started with --no-data-shm),
    or more than `fits` any frame of the shard's data plane, or the shard no longer
    serves a data plane (it restarted with --data-port -1, and the retry's GetJob said
    so). The caller goes over gRPC, which streams them."""


def fits(dp: DataPlaneClient, nbytes: int) -> bool:
    """Might one frame carry `nbytes` of rows to or from this shard (its segment, or a
    payload within the frame size the worker was given)? A connection whose shard did
    not attach the segment carries only a frame's worth (UseGrpc past that)."""
    return nbytes <= max(dp.max_frame_bytes, dp.shm_bytes)


def _room(dp: DataPlaneClient, conn: Any, nbytes: int) -> bool:
    """Does `conn` carry `nbytes` in one frame: a payload within the frame size, or its
    segment (a call's bytes start at the ring's start, so all of the ring is free)?"""
    if nbytes <= dp.max_frame_bytes:
        return True
    return conn.segment is not None and nbytes <= conn.segment.ring


@dataclass
class _Call:
    """One rows call on a pooled connection: back to the pool at its end only where
    `reusable` (its reply, or a refusal, read whole)."""

    dp: DataPlaneClient
    conn: Any
    deadline: float
    reusable: bool = False


@contextlib.contextmanager
def _call(dp: Transport, nbytes: int, timeout_s: float, what: str) -> Iterator[_Call]:
    """A connection of the shard's data plane that carries `nbytes` of rows in one frame;
    UseGrpc (nothing sent) where `dp` is no data plane or none of its connections can."""
    if not isinstance(dp, DataPlaneClient) or not fits(dp, nbytes):
        raise UseGrpc(f"{nbytes} bytes of rows, on no data plane or too many for it")
    deadline = time.monotonic() + timeout_s
    call = _Call(dp, dp._acquire(deadline), deadline)
    try:
        if not _room(dp, call.conn, nbytes):
            call.reusable = True  # nothing sent
            raise UseGrpc(f"{nbytes} bytes of rows {what} {dp.address}")
        yield call
    finally:
        dp._release(call.conn, call.reusable)


def pull_rows(
    dp: Transport,
    req: pb.PullRowsRequest,
    ids: memoryview,
    take: Callable[[int, memoryview], T],
    *,
    rows_bytes: int,
    timeout_s: float,
) -> T:
    """Ask for the rows of `ids` (int64 bytes; `req.ids` empty), `rows_bytes` of them,
    and hand them to take(version, bytes) (the bytes are valid only during the call: copy
    them out). UseGrpc where they cannot go this way (`dp` may be the shard's gRPC
    transport, on a retry after the shard's data plane went away)."""
    with _call(dp, rows_bytes, timeout_s, "from") as c:
        dp, conn, deadline = c.dp, c.conn, c.deadline
        dp._send(conn, pb.DataFrame(rows_pull=pb.DataRowsPull(request=req)), ids, deadline)
        frame, plen = dp._io(conn, deadline, "rows pull", dp._read_header, conn)
        kind = frame.WhichOneof("kind")
        if kind != "rows":
            c.reusable = kind == "status" and not plen
            dp._unexpected(frame, "rows")
        rows = frame.rows
        if rows.shm_bytes:
            out = _take_shm(dp, conn, rows, plen, take)
        else:
            data = dp._io(
                conn, deadline, "rows pull", fr.recv_payload, conn.sock, plen, conn.scratch
            )
            try:
                out = take(rows.version, data)
            finally:
                data.release()
        c.reusable = True
        return out


def _take_shm(dp: DataPlaneClient, conn: Any, rows: Any, plen: int, take: Callable) -> Any:
    """take(version, bytes) of rows a DataRows says lie in the connection's segment."""
    segment = conn.segment
    try:
        if segment is None or plen:
            raise ValueError("a payload too" if plen else "no segment on this connection")
        if rows.shm_at + rows.shm_bytes >= 1 << 64:  # stored as a u64 once read
            raise ValueError(f"shm_at {rows.shm_at} ends past the 64-bit position")
        data = segment.get(rows.shm_at, rows.shm_bytes)
    except ValueError as e:
        raise DataPlaneError(
            SC.INTERNAL, f"data plane of {dp.address}: bad shared-memory rows: {e}"
        ) from None
    try:
        return take(rows.version, data)
    finally:
        data.release()
        segment.consumed(rows.shm_at, rows.shm_bytes)


def pull_tables(
    dp: Transport,
    req: pb.DataTablesPull,
    ids: list[memoryview],
    takes: Sequence[tuple[int, Callable[[int, memoryview], T]]],
    *,
    timeout_s: float,
) -> list[T]:
    """Several tables' rows in one frame each way: `req` holds each table's request
    (its ids empty) and `ids_bytes`, `ids` each table's id bytes, `takes` each table's
    (bytes of rows expected, take(version, bytes)) as in pull_rows. UseGrpc as there."""
    # The shard places each table's rows at a 64-byte boundary after the previous
    # table's: all of them fit a segment only where their aligned sizes do (else the
    # last would come as a payload, perhaps larger than the shard sends).
    total = sum(-(-n // shm.ALIGN) * shm.ALIGN for n, _ in takes)
    with _call(dp, total, timeout_s, "from") as c:
        dp, conn, deadline = c.dp, c.conn, c.deadline
        dp._io(conn, deadline, "send", fr.send, conn.sock, pb.DataFrame(tables_pull=req), ids)
        frame, plen = dp._io(conn, deadline, "rows pull", dp._read_header, conn)
        kind = frame.WhichOneof("kind")
        if kind != "tables_rows":
            c.reusable = kind == "status" and not plen
            dp._unexpected(frame, "tables_rows")
        parts = frame.tables_rows.tables
        inline = sum(n for p, (n, _) in zip(parts, takes, strict=False) if not p.shm_bytes)
        if len(parts) != len(takes) or plen != inline:
            raise DataPlaneError(
                SC.INTERNAL,
                f"data plane of {dp.address}: {len(parts)} tables' rows and {plen} bytes "
                f"of payload for {len(takes)} tables asked ({inline} bytes expected there)",
            )
        payload = (
            dp._io(conn, deadline, "rows pull", fr.recv_payload, conn.sock, plen, conn.scratch)
            if plen
            else memoryview(b"")
        )
        try:
            out, at = [], 0
            for rows, (n, take) in zip(parts, takes, strict=True):
                if rows.shm_bytes:
                    out.append(_take_shm(dp, conn, rows, 0, take))
                else:
                    out.append(take(rows.version, payload[at : at + n]))
                    at += n
        finally:
            payload.release()
        c.reusable = True
        return out


def push_tables(
    dp: Transport,
    req: pb.PushTablesRequest,
    counts: Sequence[tuple[int, int]],
    pieces: Sequence[Any],
    *,
    timeout_s: float,
) -> pb.PushTablesReply:
    """Every table's row push of a step in one frame: `req` holds the headers (ids and
    data empty), `pieces` each push's id bytes then gradient bytes (byte views), in order,
    `counts` their (id bytes, gradient bytes) per push. The pieces are copied once, into
    the segment side by side, or sent from where they are as the frame's payload. UseGrpc
    where they cannot go this way (as in pull_rows)."""
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    total = sum(len(v) for v in views)
    with _call(dp, total, timeout_s, "to") as c:
        dp, conn, deadline = c.dp, c.conn, c.deadline
        head = pb.DataRowsPush(
            request=req, ids_bytes=[i for i, _ in counts], data_bytes=[d for _, d in counts]
        )
        segment = conn.segment
        got = None
        if segment is not None and total:
            segment.begin()  # this call's sender: its bytes are numbered from 0
            got = segment.reserve(total)
        if got is not None:
            at, dst = got
            pos = 0
            for v in views:  # through torch: the GIL is released while it copies
                dst[pos : pos + len(v)].copy_(wire.decode(v, torch.uint8))
                pos += len(v)
            head.shm_at, head.shm_bytes = at, total
        frame = pb.DataFrame(rows_push=head)  # a copy of head: made once it is complete
        if got is not None:
            dp._send(conn, frame, None, deadline)
        else:
            send = fr.send_buffers
            dp._io(conn, deadline, "send", send, conn.sock, [fr.encode(frame, total), *views])
        frame = dp._recv_frame(conn, deadline, "rows push")
        c.reusable = True
        return dp._expect(frame, "rows_pushed")
