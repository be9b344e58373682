"""Client calls for sparse tables, on top of a PSClient's channels (one thread per shard).

Row r lives on shard r % S. `pull_rows` sends each shard only the ids it holds
(deduplicated by the caller) and reassembles the rows in the caller's order;
`push_rows` sends each shard its ids and row gradients (in the wire dtype).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ps import serde, wire
from ps._gen.psar.v1 import ps_pb2 as pb
from ps.client.psclient import PSClient
from ps.sparse_spec import TableSpec


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


def split_by_shard(ids: torch.Tensor, num_shards: int) -> list[torch.Tensor]:
    """Positions in `ids` of each shard's rows."""
    owner = ids % num_shards
    return [torch.nonzero(owner == i).reshape(-1) for i in range(num_shards)]


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
    parts = split_by_shard(ids, client.num_shards)
    out = torch.empty(ids.numel(), dim, dtype=out_dtype)
    got = [0] * client.num_shards

    def one(i: int) -> int:
        pos = parts[i]
        req = pb.PullRowsRequest(
            worker=client.worker,
            table=table,
            ids=_ids_bytes(ids[pos]),
            dtype=serde.dtype_to_pb(dtype),
        )

        def call(_r: bool) -> int:
            version = 0
            for msg in client._stubs[i].PullRows(req, timeout=client.cfg.pull_timeout_s):
                version = msg.version
                if msg.data:
                    rows = wire.decode(msg.data, dtype).reshape(-1, dim)
                    out[pos[msg.offset : msg.offset + rows.shape[0]]] = rows.to(out_dtype)
                    got[i] += len(msg.data)
            return version

        return client._retrying(i, call)

    versions = client._each(one)
    return out, versions, sum(got) + 8 * ids.numel()


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
    parts = split_by_shard(ids, client.num_shards)
    sent = [0] * client.num_shards
    step = max(1, client.cfg.message_bytes)

    def one(i: int) -> pb.PushRowsReply:
        pos = parts[i]
        id_bytes = b"" if overflow else _ids_bytes(ids[pos])
        g = grads[pos].to(dtype).reshape(-1).contiguous() if not overflow else None

        def chunks() -> Iterator[pb.PushRowsChunk]:
            head = pb.PushRowsHeader(
                worker=client.worker,
                clock=clock,
                table=table,
                base_version=base_versions[i],
                dtype=serde.dtype_to_pb(dtype),
                loss_scale=loss_scale,
                overflow=overflow,
                num_ids=0 if overflow else pos.numel(),
            )
            yield pb.PushRowsChunk(header=head)
            for s in range(0, len(id_bytes), step):
                yield pb.PushRowsChunk(ids=id_bytes[s : s + step])
            if g is not None and g.numel():
                for _, data in wire.iter_pieces(g, step):
                    yield pb.PushRowsChunk(data=data)

        sent[i] = len(id_bytes) + (g.numel() * g.element_size() if g is not None else 0)
        return client._retrying(
            i, lambda _r: client._stubs[i].PushRows(chunks(), timeout=client.cfg.timeout_s)
        )

    replies = client._each(one)
    return replies, sum(sent)
