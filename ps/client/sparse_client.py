"""Client calls for sparse tables, on top of a PSClient's channels (one thread per shard).

Row r lives on shard r % S. `pull_rows` sends each shard only the ids it holds
(deduplicated by the caller) and reassembles the rows in the caller's order (`pull_tables`
for every table of a step at once);
`push_rows` sends each shard its ids and row gradients (in the wire dtype); `push_tables`
does it for every table of a step at once, one unary PushTables call per shard.

Where the worker talks to a shard's data plane (--data-plane auto/tcp, the shard serves
one), both calls go there, one frame each way, the bytes in a shared-memory segment on
the same host (ps/client/tcp_rows.py, ps/server/doors/dataplane_rows.py): over gRPC a
shard spent half of its CPU in the asyncio server moving row bytes (issue #46). A call
too large for one frame (a payload of ClientConfig.data_frame_bytes, or the segment where
the shard attached one), and every call under --data-plane grpc, goes over gRPC.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from psar.ps import serde, wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client import tcp_rows
from psar.ps.client.psclient import PSClient
from psar.ps.client.transport import TransportError
from psar.ps.sparse_spec import TableSpec


def _ids_bytes(ids: torch.Tensor) -> bytes:
    return bytes(wire.as_bytes_view(ids.to(torch.int64).contiguous())) if ids.numel() else b""


def create_tables(client: PSClient, specs_per_shard: Sequence[Sequence[TableSpec]]) -> list[int]:
    """Create the tables on every shard (identical repeats are fine); bytes held per shard."""

    def one(i: int) -> int:
        req = pb.CreateTablesRequest(tables=[serde.spec_to_pb(s) for s in specs_per_shard[i]])
        r = client._retrying(
            i,
            lambda _r: client._stubs[i].CreateTables(
                req, timeout=client.cfg.pull_timeout_s, wait_for_ready=True
            ),
        )
        return int(r.table_bytes)

    return client._each(one)


def split_by_shard(ids: torch.Tensor, num_shards: int) -> list[torch.Tensor | slice]:
    """Positions in `ids` of each shard's rows: a slice each where `ids` are grouped by
    shard already (group_by_shard's order: no gather, no scatter), else index tensors."""
    owner = ids % num_shards
    if ids.numel() < 2 or bool((owner[1:] >= owner[:-1]).all()):
        ends = torch.bincount(owner, minlength=num_shards).cumsum(0).tolist()
        return [slice(a, b) for a, b in zip([0, *ends[:-1]], ends, strict=True)]
    return [torch.nonzero(owner == i).reshape(-1) for i in range(num_shards)]


def _count(pos: torch.Tensor | slice) -> int:
    return pos.stop - pos.start if isinstance(pos, slice) else pos.numel()


def _index(pos: torch.Tensor | slice) -> torch.Tensor:
    return torch.arange(pos.start, pos.stop) if isinstance(pos, slice) else pos


def group_by_shard(
    uniq: torch.Tensor, inv: torch.Tensor, num_shards: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted unique ids (and the inverse of torch.unique) reordered shard by shard, each
    shard's still sorted: its rows are then one slice of the pulled rows and of the
    pushed gradients (split_by_shard)."""
    if num_shards == 1 or uniq.numel() < 2:
        return uniq, inv
    order = torch.argsort(uniq % num_shards, stable=True)
    where = torch.empty_like(order)
    where[order] = torch.arange(order.numel())
    return uniq[order], where[inv]


@dataclass
class RowsPull:
    """One table's rows to pull: unique `ids` (grouped by shard, or not), each of `dim`
    values, handed back as `out_dtype`."""

    table: str
    ids: torch.Tensor
    dim: int
    out_dtype: torch.dtype = torch.float32


def pull_rows(
    client: PSClient,
    table: str,
    ids: torch.Tensor,
    dim: int,
    dtype: torch.dtype,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, list[int], int]:
    """Rows for unique `ids` as (len(ids), dim) `out_dtype`; also the table's version on
    every shard and the bytes received."""
    return pull_tables(client, [RowsPull(table, ids, dim, out_dtype)], dtype)[0]


def pull_tables(
    client: PSClient, pulls: Sequence[RowsPull], dtype: torch.dtype
) -> list[tuple[torch.Tensor, list[int], int]]:
    """`pull_rows` for several tables at once, pulled in `dtype`: each shard's data plane
    gets every table's ids in one frame and sends every table's rows in one (one round
    trip a step, and a frame read and sent by the shard per step rather than per table);
    over gRPC, one PullRows stream per table. All shards are asked together. Per table:
    (rows, versions, bytes received), as pull_rows."""
    if not pulls:
        return []
    n = client.num_shards
    parts = [split_by_shard(p.ids, n) for p in pulls]
    outs = [torch.empty(p.ids.numel(), p.dim, dtype=p.out_dtype) for p in pulls]
    got = [[0] * n for _ in pulls]
    size = wire.DTYPE_ITEMSIZE[dtype]

    def one(i: int) -> list[int]:
        mine = [pp[i] for pp in parts]
        wants = [_count(pos) * p.dim * size for p, pos in zip(pulls, mine, strict=True)]
        if _rows_door(client, i, sum(wants)):
            done = _pull_on_data_plane(client, i, pulls, mine, wants, dtype, outs)
            if done is not None:
                for t, want in enumerate(wants):
                    got[t][i] = want
                return done
            # else: too large for this connection, or no data plane now: gRPC below
        return [
            _pull_grpc(client, i, p, pos, dtype, out, got[t])
            for t, (p, pos, out) in enumerate(zip(pulls, mine, outs, strict=True))
        ]

    versions = client._each(one)
    return [
        (outs[t], [versions[i][t] for i in range(n)], sum(got[t]) + 8 * p.ids.numel())
        for t, p in enumerate(pulls)
    ]


def _pull_grpc(
    client: PSClient,
    i: int,
    p: RowsPull,
    pos: torch.Tensor | slice,
    dtype: torch.dtype,
    out: torch.Tensor,
    got: list[int],
) -> int:
    """Shard i's rows of `p.ids[pos]` over a PullRows stream, into out[pos]: the table's
    version there (bytes received added to got[i])."""
    pos = _index(pos)  # a stream's pieces land at pos[offset:]
    req = pb.PullRowsRequest(
        worker=client.worker,
        table=p.table,
        ids=_ids_bytes(p.ids[pos]),
        dtype=serde.dtype_to_pb(dtype),
    )

    def call(_r: bool) -> int:
        version = 0
        for msg in client._stubs[i].PullRows(req, timeout=client.cfg.pull_timeout_s):
            version = msg.version
            if msg.data:
                rows = wire.decode(msg.data, dtype).reshape(-1, p.dim)
                out[pos[msg.offset : msg.offset + rows.shape[0]]] = rows.to(out.dtype)
                got[i] += len(msg.data)
        return version

    return client._retrying(i, call)


def _pull_on_data_plane(
    client: PSClient,
    i: int,
    pulls: Sequence[RowsPull],
    mine: Sequence[torch.Tensor | slice],
    wants: Sequence[int],
    dtype: torch.dtype,
    outs: Sequence[torch.Tensor],
) -> list[int] | None:
    """Shard i's rows of every table (`p.ids[pos]` of each, `want` bytes of rows) over
    its data plane, into its out[pos]: the tables' versions there, or None where the call
    must go over gRPC. One table goes as a DataRowsPull, several as one DataTablesPull."""
    reqs, ids, takes = [], [], []
    for p, pos, want, out in zip(pulls, mine, wants, outs, strict=True):
        reqs.append(
            pb.PullRowsRequest(worker=client.worker, table=p.table, dtype=serde.dtype_to_pb(dtype))
        )
        these = p.ids[pos].contiguous()
        ids.append(wire.as_bytes_view(these) if these.numel() else memoryview(b""))
        takes.append((want, _taker(p, pos, want, dtype, out)))
    timeout = client.cfg.pull_timeout_s
    if len(pulls) == 1:
        want, take = takes[0]

        def call(t: Any) -> list[int]:
            got = tcp_rows.pull_rows(t, reqs[0], ids[0], take, rows_bytes=want, timeout_s=timeout)
            return [got]
    else:
        many = pb.DataTablesPull(requests=reqs, ids_bytes=[len(v) for v in ids])

        def call(t: Any) -> list[int]:
            return tcp_rows.pull_tables(t, many, ids, takes, timeout_s=timeout)

    try:
        return client._retrying(i, lambda _r: client.doors.via(i, call))
    except tcp_rows.UseGrpc:
        return None


def _taker(
    p: RowsPull, pos: torch.Tensor | slice, want: int, dtype: torch.dtype, out: torch.Tensor
) -> Any:
    """take(version, bytes) for one table's rows from one shard: checked, into out[pos]."""

    def take(version: int, data: memoryview) -> int:
        if len(data) != want:
            raise TransportError(
                grpc.StatusCode.INTERNAL,
                f"rows pull of table {p.table!r}: the shard sent {len(data)} bytes "
                f"for {_count(pos)} rows of {p.dim} ({want} bytes)",
            )
        if want:
            out[pos] = wire.decode(data, dtype).reshape(-1, p.dim).to(out.dtype)
        return version

    return take


@dataclass
class RowsPush:
    """One table's row gradients for one clock (unique ids, (n, dim) grads)."""

    table: str
    clock: int
    ids: torch.Tensor
    grads: torch.Tensor
    dtype: torch.dtype
    base_versions: Sequence[int]
    loss_scale: float = 1.0
    overflow: bool = False


def push_rows(
    client: PSClient,
    *,
    table: str,
    clock: int,
    ids: torch.Tensor,
    grads: torch.Tensor,
    dtype: torch.dtype,
    base_versions: Sequence[int],
    loss_scale: float = 1.0,
    overflow: bool = False,
) -> tuple[list[pb.PushRowsReply], int]:
    """Push row gradients (unique ids, (n, dim)) to the shards holding them (every shard
    gets a push, possibly empty, so sync rounds close). Returns replies and bytes sent."""
    push = RowsPush(table, clock, ids, grads, dtype, base_versions, loss_scale, overflow)
    return push_tables(client, [push])[0]


def push_tables(
    client: PSClient, pushes: Sequence[RowsPush]
) -> list[tuple[list[pb.PushRowsReply], int]]:
    """`push_rows` for several tables at once: each shard gets every table's rows in one
    unary PushTables call (one message: fewer messages and hops than a PushRows stream per
    table, which counts on a CPU-bound machine), or, when they do not fit in half of
    max_message_bytes, one PushRows stream per table. All shards are pushed to together.
    Per table: replies (one per shard) and bytes sent."""
    n = client.num_shards
    parts = [_shard_parts(client, p) for p in pushes]
    step = max(1, client.cfg.message_bytes)

    def one(i: int) -> list[pb.PushRowsReply]:
        mine = [pp[i] for pp in parts]
        total = sum(len(ids) + len(data) for _, ids, data in mine)
        if _rows_door(client, i, total):  # the shard's data plane (module docstring)
            done = _push_on_data_plane(client, i, mine)
            if done is not None:
                return done
            # else: too large for this connection, or no data plane now: gRPC below
        if total <= client.cfg.max_message_bytes // 2:
            req = pb.PushTablesRequest(
                pushes=[
                    pb.RowsPushWhole(header=h, ids=bytes(ids), data=bytes(data))
                    for h, ids, data in mine
                ]
            )
            r = client._retrying(
                i, lambda _r: client._stubs[i].PushTables(req, timeout=client.cfg.timeout_s)
            )
            return list(r.replies)
        return [
            client._retrying(
                i,
                lambda _r, m=m: client._stubs[i].PushRows(
                    _chunks(*m, step), timeout=client.cfg.timeout_s
                ),
            )
            for m in mine
        ]

    replies = client._each(one)
    return [
        ([replies[i][t] for i in range(n)], sum(len(ids) + len(data) for _, ids, data in pp))
        for t, pp in enumerate(parts)
    ]


def _push_on_data_plane(
    client: PSClient, i: int, mine: list[tuple[pb.PushRowsHeader, Any, Any]]
) -> list[pb.PushRowsReply] | None:
    """Shard i's part of every table's push (header, id bytes, gradient bytes) over its
    data plane in one frame: the replies, or None where it must go over gRPC."""
    req = pb.PushTablesRequest(pushes=[pb.RowsPushWhole(header=h) for h, _, _ in mine])
    counts = [(len(ids), len(data)) for _, ids, data in mine]
    pieces = [b for _, ids, data in mine for b in (ids, data)]
    timeout = client.cfg.timeout_s

    def call(t: Any) -> pb.PushTablesReply:
        return tcp_rows.push_tables(t, req, counts, pieces, timeout_s=timeout)

    try:
        return list(client._retrying(i, lambda _r: client.doors.via(i, call)).replies)
    except tcp_rows.UseGrpc:
        return None


def _shard_parts(client: PSClient, p: RowsPush) -> list[tuple[pb.PushRowsHeader, bytes, bytes]]:
    """Push `p` split by shard: (header, id bytes, gradient bytes in p.dtype) per shard."""
    out = []
    for i, pos in enumerate(split_by_shard(p.ids, client.num_shards)):
        ids: Any = b""
        data: Any = b""
        n = _count(pos)
        if not p.overflow and n:
            # Views of the gathered tensors (kept alive by them): the gRPC path copies
            # them into its message, the data plane into one frame or segment.
            ids = wire.as_bytes_view(p.ids[pos].to(torch.int64).contiguous())
            data = wire.as_bytes_view(p.grads[pos].to(p.dtype).reshape(-1).contiguous())
        head = pb.PushRowsHeader(
            worker=client.worker,
            clock=p.clock,
            table=p.table,
            base_version=p.base_versions[i],
            dtype=serde.dtype_to_pb(p.dtype),
            loss_scale=p.loss_scale,
            overflow=p.overflow,
            num_ids=0 if p.overflow else n,
        )
        out.append((head, ids, data))
    return out


def _chunks(head: pb.PushRowsHeader, ids: Any, data: Any, step: int) -> Iterator[pb.PushRowsChunk]:
    """A PushRows stream: the header, then ids and gradient bytes in pieces of `step`."""
    yield pb.PushRowsChunk(header=head)
    for s in range(0, len(ids), step):
        yield pb.PushRowsChunk(ids=bytes(ids[s : s + step]))
    for s in range(0, len(data), step):
        yield pb.PushRowsChunk(data=bytes(data[s : s + step]))


def _rows_door(client: PSClient, shard: int, nbytes: int) -> bool:
    """Try the shard's data plane first? Where the worker uses one and `nbytes` might fit
    one frame of it, or where its data port is stale (a connection failed): GetJob asks
    again inside the call's retries (ps/client/dataplane_calls.py), never here, outside
    them. tcp_rows says UseGrpc where the call cannot go that way after all."""
    if client.cfg.data_plane == "grpc":
        return False
    if client._data_stale[shard]:
        return True
    dp = client._data[shard]
    return dp is not None and tcp_rows.fits(dp, nbytes)
