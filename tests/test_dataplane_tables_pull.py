"""Several tables' rows in one data-plane call (sparse_client.pull_tables, proto
DataTablesPull / DataTablesRows): real shards, real sockets, real memfds.

- Through every door (gRPC, the data plane's socket, its shared-memory segment), fp32
  and fp16, a pull of several tables at once returns the same rows, versions and byte
  counts as one pull_rows per table, and a shard counts one data-plane pull per call
  where every table's rows fit one frame; a call too large for a frame goes over gRPC.
- Hostile tables_pull frames sent raw are refused with the words of the gRPC door (or
  of the frame's own layout), every table untouched, the connection still answering.
- A worker refuses a tables_rows reply that does not match what it asked for.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import torch

from psar.ps import framing as fr
from psar.ps import shm
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.client_config import ClientConfig
from psar.ps.client.errors import PSClientError
from psar.ps.client.sparse_client import RowsPull, pull_rows, pull_tables
from psar.ps.server.shard import ShardState
from psar.ps.shm import Segment
from tests.test_dataplane import read_frame
from tests.test_dataplane_rows import (
    DIM,
    DOORS,
    FRAME,
    RING,
    SHARDS,
    _answers_a_pull,
    _cluster,
    _ids,
    _spy_puts,
    lone,  # noqa: F401 - the fixture
    refused_by_fake_shard,
    tables_digest,
)
from tests.test_dataplane_shm import _hello

pytestmark = pytest.mark.skipif(not shm.available(), reason="no sealed memfds here")
SC = grpc.StatusCode

# (table, ids) per call: small (every table in the ring), ring overflow (the later
# tables in the frame's payload), and too large for a frame (gRPC, table by table).
CALLS = {
    "small": [("a", torch.tensor([7, 2, 299, 40])), ("b", torch.arange(50).flip(0))],
    "past-the-ring": [("b", torch.arange(40)), ("big", torch.arange(1000)), ("a", torch.arange(3, 9))],
    "past-a-frame": [("a", torch.arange(300)), ("big", torch.arange(4096))],
    "one-side-empty": [("a", torch.arange(1, 41, 2)), ("b", torch.empty(0, dtype=torch.int64))],
}  # fmt: skip


def _bytes(ids: torch.Tensor, item: int) -> list[int]:
    return [int((ids % SHARDS == i).sum()) * DIM * item for i in range(SHARDS)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_every_door_gives_what_a_pull_per_table_gives(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    item = 4 if dtype == torch.float32 else 2
    puts = _spy_puts(monkeypatch)
    for door, cfg in DOORS.items():
        with _cluster("async", cfg) as (clients, shards):
            c = clients[1]
            for name, call in CALLS.items():
                ref = [pull_rows(c, t, ids, DIM, dtype) for t, ids in call]
                before = [dp.stats()["row_pulls"] for dp, _ in shards]
                puts.clear()
                pulls = [RowsPull(t, ids, DIM, torch.float32) for t, ids in call]
                got = pull_tables(c, pulls, dtype)
                for (t, _), a, b in zip(call, got, ref, strict=True):
                    assert torch.equal(a[0], b[0]), (door, name, t)
                    assert a[1:] == b[1:], (door, name, t)  # versions, bytes received
                per_shard = [sum(_bytes(ids, item)[i] for _, ids in call) for i in range(SHARDS)]
                # The sizes chosen take the path the call is named for.
                assert all((n > FRAME) == (name == "past-a-frame") for n in per_shard)
                assert (max(per_shard) <= RING // 2) == (name in ("small", "one-side-empty"))
                for i, (dp, _) in enumerate(shards):
                    calls = dp.stats()["row_pulls"] - before[i]
                    if door == "grpc" or per_shard[i] > FRAME:
                        assert calls == 0, (door, name, i)
                    else:  # one data-plane call for every table
                        assert calls == 1, (door, name, i)
                if door == "shm" and name == "small":  # every table's rows in the segment
                    sizes = sorted(n for t, ids in call for n in _bytes(ids, item) if n)
                    assert sorted(n for who, n, ok in puts if who == "shard" and ok) == sizes
                if door == "shm" and name == "past-the-ring":  # some fit, the rest: payload
                    placed = {ok for who, _, ok in puts if who == "shard"}
                    assert placed == {True, False}, puts
            # The tables' bytes after the calls: the same pulls changed nothing.
            assert all(st.sparse.tables["a"].version == 0 for _, st in shards)
            refused = pytest.raises(PSClientError)
            with refused as e:
                pull_tables(c, [RowsPull("a", torch.arange(4), DIM), RowsPull("nope", torch.arange(4), DIM)], dtype)  # fmt: skip
            assert e.value.code == SC.NOT_FOUND and "no sparse table 'nope'" in e.value.details


# ---- hostile frames, raw over a socket ---------------------------------------------------


def _tables(*reqs: tuple[str, bytes], **fields: Any) -> tuple[pb.DataFrame, bytes]:
    """A tables_pull frame (worker 0, fp32) of (table, id bytes) requests, and its
    payload; `fields` override ids_bytes or a request's ids."""
    inline = fields.pop("inline", False)
    requests = [
        pb.PullRowsRequest(worker=0, table=t, dtype=pb.FLOAT32, ids=ids if inline else b"")
        for t, ids in reqs
    ]
    ask = pb.DataTablesPull(requests=requests, ids_bytes=[len(i) for _, i in reqs])
    for k, v in fields.items():
        del getattr(ask, k)[:]
        getattr(ask, k).extend(v)
    return pb.DataFrame(tables_pull=ask), b"".join(i for _, i in reqs)


BAD = {
    "counts-per-request": (_tables(("a", _ids(2)), ("b", _ids(4)), ids_bytes=[8]), SC.INVALID_ARGUMENT, "2 requests but 1 ids_bytes counts"),
    "counts-short": (_tables(("a", _ids(2, 4)), ids_bytes=[8]), SC.INVALID_ARGUMENT, "the ids_bytes counts add up to 8 bytes, 16 arrived"),
    "counts-long": (_tables(("a", _ids(2)), ("b", _ids(4)), ids_bytes=[8, 16]), SC.INVALID_ARGUMENT, "add up to 24 bytes, 16 arrived"),
    "ids-inside-a-request": (_tables(("a", _ids(2)), inline=True), SC.INVALID_ARGUMENT, "leave each request's ids empty"),
    "ragged-ids": (_tables(("a", _ids(2)[:4]), ("b", _ids(4)[:4] + _ids(6))), SC.INVALID_ARGUMENT, "4 bytes is not a whole number of int64"),
    "ids-of-another-shard": (_tables(("a", _ids(2)), ("b", _ids(3))), SC.INVALID_ARGUMENT, "table 'b': rows [3] are not held by shard 0 of 2"),
    "ids-out-of-range": (_tables(("a", _ids(2)), ("b", _ids(60))), SC.INVALID_ARGUMENT, "table 'b': row ids out of range [0, 50): [60]"),
    "duplicate-ids": (_tables(("b", _ids(4, 4))), SC.INVALID_ARGUMENT, "table 'b': duplicate row ids [4]"),
    "unknown-table-second": (_tables(("a", _ids(2)), ("nope", _ids(2))), SC.NOT_FOUND, "no sparse table 'nope' on this shard"),
    "rows-over-a-frame": (_tables(("big", _ids(*range(0, 1200, 2))), ("big", _ids(*range(1200, 2400, 2)))), SC.RESOURCE_EXHAUSTED, "38400 bytes of rows is more than one frame of this shard holds"),
}  # fmt: skip


@pytest.mark.parametrize("attach", [False, True], ids=["socket", "segment"])
@pytest.mark.parametrize(("framed", "code", "words"), list(BAD.values()), ids=list(BAD))
def test_a_hostile_tables_pull_is_refused_and_changes_no_table(
    lone: tuple[Any, ShardState],  # noqa: F811 - the fixture imported above
    framed: tuple[pb.DataFrame, bytes],
    code: SC,
    words: str,
    attach: bool,
) -> None:
    dp, st = lone
    seg = Segment.create(4096) if attach else None
    try:
        sock, status = _hello(dp.port, seg.path if seg else "", seg.nonce if seg else b"")
        with sock:
            assert status.code == 0 and status.shm == attach
            before = tables_digest(st)
            frame, payload = framed
            sock.sendall(fr.encode(frame, len(payload)) + payload)
            reply = read_frame(sock)
            assert reply.WhichOneof("kind") == "status", reply
            assert reply.status.code == code.value[0], reply.status
            assert words in reply.status.details, reply.status.details
            assert tables_digest(st) == before
            _answers_a_pull(sock, seg, st)  # the connection still serves
    finally:
        if seg is not None:
            seg.close()


def test_a_good_tables_pull_sends_every_table_in_order(lone: tuple[Any, ShardState]) -> None:  # noqa: F811
    """Raw: two tables (one of them twice) and an empty request, rows in the payload in
    the requests' order, each with its table's version."""
    dp, st = lone
    sock, _ = _hello(dp.port, "", b"")
    with sock:
        frame, payload = _tables(
            ("b", _ids(48, 0)), ("a", b""), ("a", _ids(298, 4)), ("b", _ids(2))
        )
        sock.sendall(fr.encode(frame, len(payload)) + payload)
        reply, plen = fr.read_header(sock, max_payload_bytes=1 << 20, scratch=fr.Scratch())
        assert reply.WhichOneof("kind") == "tables_rows", reply
        parts = reply.tables_rows.tables
        assert [p.shm_bytes for p in parts] == [0] * 4 and plen == 5 * DIM * 4
        data = torch.frombuffer(bytearray(fr.recv_payload(sock, plen, fr.Scratch())), dtype=torch.float32)  # fmt: skip
        a, b = st.sparse.tables["a"], st.sparse.tables["b"]
        want = torch.cat([b.weight[[24, 0]], a.weight[[149, 2]], b.weight[[1]]])
        assert torch.equal(data.reshape(-1, DIM), want)
        assert [p.version for p in parts] == [b.version, a.version, a.version, b.version]
        _answers_a_pull(sock, None, st)


# ---- the worker refuses a reply that is not what it asked for -----------------------------


def _reply(parts: list[dict[str, int]], nbytes: int) -> Any:
    """Answer a tables_pull with these DataRows and `nbytes` of payload."""
    rows = [pb.DataRows(version=3, **p) for p in parts]
    frame = pb.DataFrame(tables_rows=pb.DataTablesRows(tables=rows))
    return lambda sock, _ids: sock.sendall(fr.encode(frame, nbytes) + b"\0" * nbytes)


ROW = DIM * 4  # one fp32 row; the worker asks for 2 rows of "t" and 1 of "u"
REPLIES = {
    "one-table-short": (_reply([{}], 3 * ROW), False, "1 tables' rows and 96 bytes of payload for 2 tables asked"),
    "payload-short": (_reply([{}, {}], 2 * ROW), False, "64 bytes of payload for 2 tables asked (96 bytes expected there)"),
    "payload-long": (_reply([{}, {}], 4 * ROW), False, "128 bytes of payload for 2 tables asked (96 bytes expected there)"),
    "segment-without-a-segment": (_reply([{"shm_at": 0, "shm_bytes": 2 * ROW}, {}], ROW), False, "bad shared-memory rows: no segment on this connection"),
    "segment-wrong-size": (_reply([{}, {"shm_at": 0, "shm_bytes": 2 * ROW}], 2 * ROW), True, "the shard sent 64 bytes for 1 rows of 8 (32 bytes)"),
    "segment-outside-the-ring": (_reply([{"shm_at": 4096 - 8, "shm_bytes": 2 * ROW}, {}], ROW), True, "does not lie inside the shared segment's ring"),
}  # fmt: skip


@pytest.mark.parametrize(("answer", "shm_ok", "words"), list(REPLIES.values()), ids=list(REPLIES))
def test_the_worker_refuses_tables_rows_that_do_not_match(
    answer: Any, shm_ok: bool, words: str
) -> None:
    pulls = [RowsPull("t", torch.tensor([5, 0]), DIM), RowsPull("u", torch.tensor([9]), DIM)]
    pull = lambda c: pull_tables(c, pulls, torch.float32)  # noqa: E731
    refused_by_fake_shard(answer, shm_ok, words, pull, kind="tables_pull")


def test_tables_that_fill_the_ring_only_unaligned_go_over_grpc() -> None:
    """A segment's pieces start 64-byte aligned, so two tables whose rows fill the ring
    exactly, one of an odd number of rows first, do not fit in it together: the call
    (larger than a frame) goes over gRPC, never as a payload larger than the shard
    takes (RESOURCE_EXHAUSTED)."""
    small = {"max_message_bytes": 32 << 10, "message_bytes": 8 << 10}
    row = DIM * 4
    ring = row + 1100 * row  # "a": 1 row (64 bytes once aligned), "big": 1,100 rows
    cfg = ClientConfig(data_shm_mib=ring / (1 << 20), data_frame_bytes=16 << 10, **small)
    with _cluster("async", cfg, **small) as (clients, shards):
        c = clients[0]
        pulls = [RowsPull("a", torch.tensor([2]), DIM), RowsPull("big", torch.arange(0, 2200, 2), DIM)]  # fmt: skip
        got = pull_tables(c, pulls, torch.float32)  # every row on shard 0
        assert shards[0][0].stats()["row_pulls"] == 0  # gRPC
        for p, (rows, versions, nbytes) in zip(pulls, got, strict=True):
            ref = pull_rows(c, p.table, p.ids, DIM, torch.float32)  # each alone: the ring
            assert torch.equal(rows, ref[0]) and (versions, nbytes) == ref[1:], p.table
        assert shards[0][0].stats()["row_pulls"] == 2
