"""Sparse rows over the data plane (ps/client/tcp_rows.py, ps/server/doors/dataplane_rows.py):
real shards, real sockets, real memfds.

- The same row pushes and pulls (two workers, sync and async, fp32 and fp16 on the wire,
  a loss scale, an overflowed table) through gRPC, the data plane's socket and its
  shared-memory segment leave the shards' tables bit for bit equal (rows, optimizer state,
  versions, clocks) and return the same rows, versions, replies and byte counts. The
  shards' data-plane counters and the segments' own puts say which door and which path
  each call took: a call larger than the ring goes in the frame, one larger than a frame
  over gRPC, and a call the connection it got cannot carry (no segment attached) too.
- Hostile frames sent raw to the data plane are refused with the status and the words of
  the gRPC door, every table untouched; where the frame was read whole, the same
  connection still answers a rows pull.
- A worker refuses a shard's rows reply of the wrong size or place (a fake shard on a
  real socket); it goes over gRPC to a shard restarted without a data plane, and waits
  for a restarting shard whose data port went stale like for any call.
"""

from __future__ import annotations

import contextlib
import hashlib
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch

from psar.ps import framing as fr
from psar.ps import shm
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.client_config import ClientConfig
from psar.ps.client.errors import PSClientError
from psar.ps.client.psclient import PSClient
from psar.ps.client.sparse_client import RowsPush, create_tables, pull_rows, push_tables
from psar.ps.server.config import ServerConfig
from psar.ps.server.serve import start_server, stop_server
from psar.ps.server.shard import ShardState
from psar.ps.server.sparse.table import SparseTable
from psar.ps.shm import Segment
from psar.ps.sparse_spec import TableSpec
from tests.ps_fixtures import free_port, grad_for, init_values, make_job, push
from tests.test_dataplane import read_frame
from tests.test_dataplane_shm import _hello

pytestmark = pytest.mark.skipif(not shm.available(), reason="no sealed memfds here")
SC = grpc.StatusCode
SHARDS, DIM, WORKERS = 2, 8, 2
TABLES = {"a": (300, "adagrad"), "b": (50, "lazy_adam"), "big": (4096, "sgd")}
RING = 4096  # the shm door's segment: small pushes and pulls fit it, mid-sized ones do not
FRAME = 30000  # the data-plane doors' frame: mid-sized calls fit it, the huge ones do not


def _spec(name: str, shard: int) -> TableSpec:
    rows, opt = TABLES[name]
    return TableSpec(name=name, rows=rows, dim=DIM, optimizer=opt, lr=0.3, init_std=0.1,
                     init_seed=7, shard_index=shard, num_shards=SHARDS)  # fmt: skip


def tables_digest(st: ShardState) -> str:
    """sha256 of every table's rows, optimizer state and version, and of the tables'
    clocks, open rounds and skipped counts."""
    sp = st.sparse
    h = hashlib.sha256()
    for name, t in sorted(sp.tables.items()):
        for k, v in sorted(t.state_dict().items()):
            h.update(f"{name}.{k}".encode())
            h.update(v.numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    pending = sorted((k, sorted(v)) for k, v in sp.pending.items())
    h.update(repr((sorted(sp.clocks.items()), pending, sorted(sp.skipped.items()))).encode())
    return h.hexdigest()


# ---- the same calls through every door --------------------------------------------------

DOORS = {
    "grpc": ClientConfig(data_plane="grpc"),
    "socket": ClientConfig(data_shm_mib=0, data_frame_bytes=FRAME),
    "shm": ClientConfig(data_shm_mib=RING / (1 << 20), data_frame_bytes=FRAME),
}


@contextlib.contextmanager
def _cluster(
    mode: str, cfg: ClientConfig, **server: Any
) -> Iterator[tuple[list[PSClient], list[tuple[Any, ShardState]]]]:
    """Two real shards (gRPC and data plane) holding the tables, and a client per worker
    that learnt the shards' data ports from GetJob. Yields (clients, [(data plane, state)])."""
    with contextlib.ExitStack() as stack:
        shards, ports = [], []
        for i in range(SHARDS):
            srv, port, st = start_server(ServerConfig(bind="127.0.0.1:0", threads=4, **server))
            stack.callback(stop_server, srv)
            job = make_job(mode, num_workers=WORKERS, shard_index=i, num_shards=SHARDS)
            st.init(job, init_values(job))
            shards.append((srv.psar_dataplane, st))
            ports.append(port)
        clients = []
        for w in range(WORKERS):
            clients.append(PSClient([f"127.0.0.1:{p}" for p in ports], worker=w, cfg=cfg))
            stack.callback(clients[-1].close)
        create_tables(clients[0], [[_spec(n, i) for n in TABLES] for i in range(SHARDS)])
        for c in clients:
            c.get_jobs(wait=False)  # learns the data ports (unused under data_plane="grpc")
        yield clients, shards


def _path(door: str, nbytes: int) -> str:
    """Where a call moving `nbytes` to or from one shard should go through `door`: the
    segment ("shm"), the frame's payload ("frame"), or gRPC."""
    if door == "shm" and nbytes <= RING:
        return "shm"
    if door != "grpc" and nbytes <= FRAME:
        return "frame"
    return "grpc"


def _spy_puts(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, bool]]:
    """Every room taken in a segment (Segment.reserve: a put's, or a pull's rows
    gathered straight into it; the real one runs): (whose segment: "worker" or "shard",
    bytes, placed or not)."""
    seen: list[tuple[str, int, bool]] = []
    real = Segment.reserve

    def reserve(self: Segment, n: int) -> tuple[int, torch.Tensor] | None:
        got = real(self, n)
        seen.append(("worker" if self.path else "shard", n, got is not None))
        return got

    monkeypatch.setattr(Segment, "reserve", reserve)
    return seen


def _push_ids(name: str, clock: int, w: int) -> torch.Tensor:
    if name == "big":  # mid-sized at clock 2 (500 rows a shard), every row at clock 3
        return torch.arange(4096) if clock == 3 else torch.arange(500 * w, 500 * w + 1000)
    g = torch.Generator().manual_seed(100 * clock + 10 * w + len(name))
    return torch.randperm(TABLES[name][0], generator=g)[: {"a": 40, "b": 16}[name]].sort().values


PULLS = {  # table: ids (unsorted: the rows come back in their order)
    "a": torch.randperm(300, generator=torch.Generator().manual_seed(1))[:200],
    "b": torch.arange(50).flip(0),
    "big": torch.arange(1000),
}


def _run(mode: str, dtype: torch.dtype, door: str, puts: list[Any]) -> dict[str, Any]:
    """Three clocks of both workers' row pushes, each worker pulling after its push and
    worker 0 once the clock's rounds closed: small calls (the ring), mid-sized ones (a
    frame), huge ones (gRPC); also a loss scale and an overflowed table. What came back,
    the shards' tables and counters, the segments' puts (`puts`, from _spy_puts), and each
    call's bytes per shard; then the refusals of three bad calls."""
    item = 4 if dtype == torch.float32 else 2
    rec: dict[str, Any] = {"pushes": [], "pulls": [], "calls": []}
    with _cluster(mode, DOORS[door]) as (clients, shards):
        versions = {n: [0] * SHARDS for n in TABLES}

        def pull(name: str, ids: torch.Tensor, w: int = 0) -> None:
            rows, vs, nbytes = pull_rows(clients[w], name, ids, DIM, dtype)
            versions[name] = vs
            rec["pulls"].append((name, rows, vs, nbytes))
            for i in range(SHARDS):
                rec["calls"].append(("pull", i, int((ids % SHARDS == i).sum()) * DIM * item))

        for clock in (1, 2, 3):
            names = {1: ("a", "b"), 2: ("a", "b", "big"), 3: ("a", "big")}[clock]
            for w, c in enumerate(clients):
                pushes = []
                for n in names:
                    ids = _push_ids(n, clock, w)
                    g = torch.Generator().manual_seed(1000 * clock + 10 * w + len(n))
                    grads = torch.randn(ids.numel(), DIM, generator=g) * 0.1
                    scale = 4.0 if clock == 2 else 1.0
                    over = clock == 2 and w == 1 and n == "b"
                    pushes.append(RowsPush(n, clock, ids, grads * scale, dtype, versions[n],
                                           loss_scale=scale, overflow=over))  # fmt: skip
                for p, (replies, nbytes) in zip(pushes, push_tables(c, pushes), strict=True):
                    got = [(r.applied, r.already_applied, r.version, r.staleness) for r in replies]
                    rec["pushes"].append((w, clock, p.table, got, nbytes))
                for i in range(SHARDS):
                    rows = sum(int((p.ids % SHARDS == i).sum()) for p in pushes if not p.overflow)
                    rec["calls"].append(("push", i, rows * (8 + DIM * item)))
                # On the connection that carried the push, before the round closes: its
                # buffers (frame, segment) are written over while a sync round holds the rows.
                pull("a", PULLS["a"], w)
                pull("big", PULLS["big"], w)
            for _, st in shards:  # the dense round of this clock closes too (sync rows
                for w in range(WORKERS):  # wait for it: ps/server/modes/rows.py)
                    push(st, worker=w, clock=clock, base_version=st.version,
                         grads=grad_for(st.job, w, clock))  # fmt: skip
            for name, ids in PULLS.items():
                pull(name, ids)
        pull("big", torch.arange(4096))  # every row: too large for a frame
        pull("b", torch.arange(1, 50, 2))  # nothing asked of shard 0 (its version still)
        pull("a", torch.empty(0, dtype=torch.int64))
        rec["stats"] = [dp.stats() for dp, _ in shards]
        rec["digests"] = [tables_digest(st) for _, st in shards]
        rec["puts"] = list(puts)
        bad = [  # a row out of range; a gradient not finite
            RowsPush("a", 9, torch.tensor([4000]), torch.ones(1, DIM), dtype, [0, 0]),
            RowsPush("b", 9, torch.tensor([2]), torch.full((1, DIM), float("inf")), dtype, [0, 0]),
        ]
        unknown = lambda: pull_rows(clients[0], "nope", torch.arange(4), DIM, dtype)  # noqa: E731
        rec["refused"] = [_refusal(unknown)]
        rec["refused"] += [_refusal(lambda p=p: push_tables(clients[1], [p])) for p in bad]
    return rec


def _refusal(call: Callable[[], object]) -> tuple[Any, str]:
    """The code and words of the PSClientError `call` raises."""
    with pytest.raises(PSClientError) as e:
        call()
    return e.value.code, e.value.details


def _check_paths(door: str, rec: dict[str, Any]) -> None:
    """The shards' counters and the segments' puts show each call where _path puts it."""
    calls = [(kind, i, n, _path(door, n)) for kind, i, n in rec["calls"]]
    puts = rec["puts"]
    for i, stats in enumerate(rec["stats"]):
        for kind, key in (("push", "row_pushes"), ("pull", "row_pulls")):
            want = sum(1 for k, s, _, p in calls if (k, s) == (kind, i) and p != "grpc")
            assert stats[key] == want, (door, i, key)
        assert (stats["shm"] > 0) == (door == "shm"), (door, stats)
        if door == "grpc":
            assert stats["accepted"] == 0
    if door != "shm":
        assert puts == []
        return
    for kind in ("push", "pull"):  # the sizes chosen do exercise every path
        assert {p for k, _, _, p in calls if k == kind} == {"shm", "frame", "grpc"}, kind

    def sizes(kind: str, path: str) -> list[int]:
        return sorted(n for k, _, n, p in calls if k == kind and p == path and n)

    def put(side: str, placed: bool) -> list[int]:
        return sorted(n for s, n, ok in puts if s == side and ok == placed)

    # The worker places a push's bytes, the shard a pull's rows; too large: the frame.
    assert put("worker", True) == sizes("push", "shm")
    assert put("worker", False) == sizes("push", "frame")
    assert put("shard", True) == sizes("pull", "shm")
    assert put("shard", False) == sizes("pull", "frame")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_door_leaves_the_same_tables_and_returns_the_same_rows(
    mode: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    puts = _spy_puts(monkeypatch)
    got = {}
    for door in DOORS:
        puts.clear()
        got[door] = _run(mode, dtype, door, puts)
        _check_paths(door, got[door])
    ref = got["grpc"]
    assert all(v > 0 for _, _, vs, _ in ref["pulls"][-6:] for v in vs)  # every table moved
    assert any(r[0] and r[3] for *_, rs, _ in ref["pushes"] for r in rs) == (mode == "async")
    assert [code for code, _ in ref["refused"]] == [SC.NOT_FOUND] + [SC.INVALID_ARGUMENT] * 2
    for door in ("socket", "shm"):
        assert got[door]["refused"] == ref["refused"], door  # the same codes and words
        assert got[door]["digests"] == ref["digests"], door  # bit for bit, both shards
        assert got[door]["pushes"] == ref["pushes"], door  # replies and bytes sent
        for a, b in zip(got[door]["pulls"], ref["pulls"], strict=True):
            assert a[0] == b[0] and a[2:] == b[2:], (door, a[0])  # versions, bytes received
            assert torch.equal(a[1], b[1]), (door, a[0])


# ---- hostile frames, raw over a socket ---------------------------------------------------

MAX = 32 << 10  # the lone shard's --max-message-bytes
TIMEOUT = 10.0


@pytest.fixture(scope="module")
def lone() -> Iterator[tuple[Any, ShardState]]:
    """One real shard (shard 0 of 2: it holds the even rows) of an async 2-worker job with
    tables "a" (adagrad), "b" (lazy_adam) and "big" (sgd: 64 KiB of rows, more than one
    frame); pushes apply on arrival, so a push that slipped through would change a table.
    Every test but test_the_good_push_alone_is_applied leaves it as it found it."""
    cfg = ServerConfig(bind="127.0.0.1:0", threads=4, max_message_bytes=MAX, message_bytes=16 << 10)
    srv, _, st = start_server(cfg)
    try:
        job = make_job("async", num_workers=WORKERS, shard_index=0, num_shards=SHARDS)
        st.init(job, init_values(job))
        st.sparse.create([_spec("a", 0), _spec("b", 0), _spec("big", 0)])
        yield srv.psar_dataplane, st
    finally:
        stop_server(srv)


Part = tuple[pb.PushRowsHeader, bytes, bytes]


def _part(table: str = "a", ids: tuple[int, ...] = (2, 4), grads: Any = None, **head: Any) -> Part:
    """One table's push: (header, id bytes, fp32 gradient bytes)."""
    g = torch.full((len(ids), DIM), 0.5) if grads is None else grads
    fields = {"worker": 0, "clock": 1, "table": table, "num_ids": len(ids),
              "dtype": pb.FLOAT32, "loss_scale": 1.0, **head}  # fmt: skip
    ids_b = torch.tensor(ids, dtype=torch.int64).numpy().tobytes()
    return pb.PushRowsHeader(**fields), ids_b, g.float().numpy().tobytes()


GOOD = _part()  # applied alone; refused with every bad part below (the call is one)


def _push(parts: list[Part], *, inline: bool = False, **fields: Any) -> tuple[pb.DataFrame, bytes]:
    """A rows_push frame of `parts` and its payload (ids then data, push after push);
    `fields` override the counts or name shared-memory bytes."""
    req = pb.PushTablesRequest(
        pushes=[
            pb.RowsPushWhole(header=h, ids=i if inline else b"", data=d if inline else b"")
            for h, i, d in parts
        ]
    )
    counts = {"ids_bytes": [len(i) for _, i, _ in parts],
              "data_bytes": [len(d) for _, _, d in parts]}  # fmt: skip
    push = pb.DataRowsPush(request=req, **{**counts, **fields})
    return pb.DataFrame(rows_push=push), b"".join(i + d for _, i, d in parts)


def _pull(payload: bytes, table: str = "a", **req: Any) -> tuple[pb.DataFrame, bytes]:
    """A rows_pull frame of table `table` and its payload (the ids)."""
    fields = {"worker": 0, "table": table, "dtype": pb.FLOAT32, **req}
    frame = pb.DataFrame(rows_pull=pb.DataRowsPull(request=pb.PullRowsRequest(**fields)))
    return frame, payload


def _ids(*ids: int) -> bytes:
    return torch.tensor(ids, dtype=torch.int64).numpy().tobytes()


@dataclass
class Bad:
    frame: pb.DataFrame
    payload: bytes = b""
    words: tuple[str, ...] = ()
    code: SC = SC.INVALID_ARGUMENT
    closes: bool = False
    """The shard closes the connection after its status (the frame was not read whole,
    or is no call at all); else the same connection answers a rows pull next."""
    segment: bytes | None = None
    """Offer a segment in the hello, these bytes placed where the frame's shm_at says."""
    claim: int | None = None
    """The payload length the frame's prefix claims (none of it is sent)."""


def _bad(framed: tuple[pb.DataFrame, bytes], *words: str, **kw: Any) -> Bad:
    return Bad(framed[0], framed[1], words, **kw)


def _ragged() -> Part:
    head, ids, data = _part("b")
    return head, ids, data + b"\0\0"  # 66 bytes of fp32 gradient


BLOB = GOOD[1] + GOOD[2]  # GOOD's bytes, as a segment would hold them
PAST = (1 << 64) - len(BLOB)  # a ring position, but its end is at 2**64
BAD = {
    # how the bytes are laid out
    "counts-short": _bad(_push([GOOD], data_bytes=[len(GOOD[2]) - 4]), "counts add up to 76 bytes, 80 arrived"),
    "counts-long": _bad(_push([GOOD], ids_bytes=[24]), "counts add up to 88 bytes, 80 arrived"),
    "counts-per-push": _bad(_push([GOOD, _part("b")], ids_bytes=[16]), "2 pushes but 1 ids_bytes and 2 data_bytes"),
    "bytes-inside-the-request": _bad(_push([GOOD], inline=True), "leave each push's ids and data empty"),
    "shm-without-segment": _bad((_push([GOOD], shm_at=0, shm_bytes=80)[0], b""), "this connection has no segment", "send its bytes in the frame"),
    "shm-outside-the-ring": _bad((_push([GOOD], shm_at=4096 - 40, shm_bytes=80)[0], b""), "does not lie inside the shared segment's ring", segment=BLOB),
    "shm-larger-than-the-ring": _bad((_push([GOOD], shm_at=0, shm_bytes=4097)[0], b""), "does not lie inside the shared segment's ring", segment=BLOB),
    "shm-and-a-payload": _bad(_push([GOOD], shm_at=0, shm_bytes=80), "also carries a payload", segment=BLOB),
    "shm-ending-at-2**64": _bad((_push([GOOD], shm_at=PAST, shm_bytes=80)[0], b""), "past the 64-bit", segment=BLOB),
    # what the bytes say
    "non-finite-gradient": _bad(_push([GOOD, _part("b", grads=torch.tensor([[float("nan")] * DIM] * 2))]), "table 'b': non-finite row gradient without the overflow flag"),
    "duplicate-ids": _bad(_push([GOOD, _part("b", (2, 2))]), "table 'b': duplicate row ids [2]"),
    "ids-out-of-range": _bad(_push([GOOD, _part("b", (2, 60))]), "table 'b': row ids out of range [0, 50): [60]"),
    "ids-of-another-shard": _bad(_push([GOOD, _part("b", (2, 3))]), "rows [3] are not held by shard 0 of 2"),
    "ragged-ids": _bad(_push([GOOD, _part("b")], ids_bytes=[16, 12], data_bytes=[64, 68]), "12 bytes is not a whole number of int64"),
    "ids-not-as-the-header-says": _bad(_push([GOOD, _part("b", num_ids=3)]), "table 'b': header says 3 ids, got 2"),
    "ragged-gradient": _bad(_push([GOOD, _ragged()]), "table 'b': ragged gradient bytes"),
    "gradient-of-the-wrong-width": _bad(_push([GOOD, _part("b", grads=torch.ones(2, DIM + 1))]), "table 'b': expected 2 x 8 gradient values", "wrong embedding width"),
    "unknown-table": _bad(_push([GOOD, _part("nope")]), "no sparse table 'nope' on this shard", code=SC.NOT_FOUND),
    "a-table-twice": _bad(_push([GOOD, _part("a", (6,))]), "a table named twice in ['a', 'a']"),
    "two-workers": _bad(_push([GOOD, _part("b", worker=1)]), "pushes of one worker only"),
    "worker-out-of-range": _bad(_push([_part("b", worker=9)]), "worker 9 not in [0, 2)"),
    "non-finite-loss-scale": _bad(_push([GOOD, _part("b", loss_scale=float("nan"))]), "loss_scale must be a finite number >= 0"),
    "unknown-dtype": _bad(_push([GOOD, _part("b", dtype=99)]), "unknown dtype enum 99"),
    "push-over-max-message-bytes": _bad((_push([GOOD])[0], b""), f"payload of {MAX + 1} bytes is larger than max_message_bytes {MAX}", code=SC.RESOURCE_EXHAUSTED, closes=True, claim=MAX + 1),
    # pulls
    "pull-ragged-ids": _bad(_pull(_ids(2)[:4] + _ids(4)), "12 bytes is not a whole number of int64"),
    "pull-ids-inside-the-request": _bad(_pull(_ids(2), ids=_ids(2)), "leave request.ids empty"),
    "pull-ids-of-another-shard": _bad(_pull(_ids(2, 5)), "table 'a': rows [5] are not held by shard 0 of 2"),
    "pull-ids-out-of-range": _bad(_pull(_ids(-2)), "table 'a': row ids out of range [0, 300): [-2]"),
    "pull-duplicate-ids": _bad(_pull(_ids(4, 4)), "table 'a': duplicate row ids [4]"),
    "pull-unknown-table": _bad(_pull(_ids(2), table="nope"), "no sparse table 'nope' on this shard", code=SC.NOT_FOUND),
    "pull-worker-out-of-range": _bad(_pull(_ids(2), worker=2), "worker 2 not in [0, 2)"),
    "pull-unknown-dtype": _bad(_pull(_ids(2), dtype=99), "unknown dtype enum 99"),
    "pull-over-max-message-bytes": _bad((_pull(b"")[0], b""), f"larger than max_message_bytes {MAX}", code=SC.RESOURCE_EXHAUSTED, closes=True, claim=MAX + 8),
    "pull-rows-over-max-message-bytes": _bad(_pull(_ids(*range(0, 2200, 2)), table="big"), f"35200 bytes of rows is more than one frame of this shard holds ({MAX}", code=SC.RESOURCE_EXHAUSTED),
    # the shard's own reply kinds
    "a-rows-frame": _bad((pb.DataFrame(rows=pb.DataRows(version=1)), b""), "unexpected rows frame", closes=True),
    "a-rows-frame-with-rows": _bad((pb.DataFrame(rows=pb.DataRows(version=1)), b"\0" * 32), "unexpected rows frame", closes=True),
    "a-rows-pushed-frame": _bad((pb.DataFrame(rows_pushed=pb.PushTablesReply()), b""), "unexpected rows_pushed frame", closes=True),
    "a-rows-pushed-frame-with-bytes": _bad((pb.DataFrame(rows_pushed=pb.PushTablesReply()), b"\0" * 8), "a rows_pushed frame carries a payload of 8 bytes", closes=True),
}  # fmt: skip


def _answers_a_pull(sock: socket.socket, seg: Segment | None, st: ShardState) -> None:
    """A valid rows pull on `sock` gets the table's rows (through the segment or not)."""
    ids = torch.tensor([298, 0, 4])
    frame, payload = _pull(ids.numpy().tobytes())
    sock.sendall(fr.encode(frame, len(payload)) + payload)
    reply, plen = fr.read_header(sock, max_payload_bytes=1 << 20, scratch=fr.Scratch())
    assert reply.WhichOneof("kind") == "rows", reply
    if reply.rows.shm_bytes:
        assert seg is not None and plen == 0
        data = bytes(seg.get(reply.rows.shm_at, reply.rows.shm_bytes))
    else:
        data = bytes(fr.recv_payload(sock, plen, fr.Scratch()))
    t = st.sparse.tables["a"]
    assert torch.equal(torch.frombuffer(bytearray(data), dtype=torch.float32).reshape(-1, DIM), t.weight[ids // 2])  # fmt: skip
    assert reply.rows.version == t.version


@pytest.mark.parametrize("bad", list(BAD.values()), ids=list(BAD))
def test_a_hostile_rows_frame_is_refused_and_changes_no_table(
    lone: tuple[Any, ShardState], bad: Bad
) -> None:
    dp, st = lone
    seg = Segment.create(4096) if bad.segment is not None else None
    try:
        sock, status = _hello(dp.port, seg.path if seg else "", seg.nonce if seg else b"")
        with sock:
            assert status.code == 0 and status.shm == (seg is not None)
            if seg is not None:  # the bytes where the frame says they are
                fields = bad.frame.rows_push
                pos = shm.HEADER + fields.shm_at % seg.ring
                room = min(len(bad.segment), seg.size - pos)
                seg.view[pos : pos + room] = bad.segment[:room]
            before = tables_digest(st)
            plen = len(bad.payload) if bad.claim is None else bad.claim
            sock.sendall(fr.encode(bad.frame, plen) + bad.payload)
            reply = read_frame(sock)
            assert reply.WhichOneof("kind") == "status", reply
            assert reply.status.code == bad.code.value[0], reply.status
            for w in bad.words:
                assert w in reply.status.details, reply.status.details
            assert tables_digest(st) == before
            if bad.closes:
                assert sock.recv(1) == b""  # closed after the status
            else:
                _answers_a_pull(sock, seg, st)
    finally:
        if seg is not None:
            seg.close()


def test_the_good_push_alone_is_applied(lone: tuple[Any, ShardState]) -> None:
    """The push every bad call above carries is not refused by itself (the only test
    that changes the shard: table "a")."""
    dp, st = lone
    sock, _ = _hello(dp.port, "", b"")
    with sock:
        frame, payload = _push([GOOD])
        sock.sendall(fr.encode(frame, len(payload)) + payload)
        reply = read_frame(sock)
        assert [r.applied for r in reply.rows_pushed.replies] == [True], reply
        assert st.sparse.tables["a"].version == 1
        _answers_a_pull(sock, None, st)


# ---- a call the connection cannot carry goes over gRPC -------------------------------------

SMALL_MAX = 32 << 10  # the shards' --max-message-bytes here: less than the worker's ring


@pytest.mark.parametrize("attach", [True, False], ids=["segment", "no-segment"])
def test_a_call_larger_than_a_frame_takes_the_segment_or_grpc(attach: bool) -> None:
    """A ring (1 MiB) larger than a frame (16 KiB) and than the shard's message limit:
    a call between the two goes through the segment where the shard attached it, and
    over gRPC (which streams it) where it did not (--no-data-shm here; another host
    alike), never as a payload the shard must refuse (RESOURCE_EXHAUSTED)."""
    small = {"max_message_bytes": SMALL_MAX, "message_bytes": 8 << 10}
    cfg = ClientConfig(data_shm_mib=1, data_frame_bytes=16 << 10, **small)
    with _cluster("async", cfg, data_shm=attach, **small) as (clients, shards):
        c = clients[0]
        pull_rows(c, "a", torch.arange(10), DIM, torch.float32)  # small: the data plane
        everything = torch.arange(4096)  # 2048 rows a shard: 64 KiB of rows, 80 KiB pushed
        before, _, _ = pull_rows(c, "big", everything, DIM, torch.float32)
        grads = torch.randn(4096, DIM, generator=torch.Generator().manual_seed(0))
        [(replies, _)] = push_tables(c, [RowsPush("big", 1, everything, grads, torch.float32, [0, 0])])  # fmt: skip
        assert [r.applied for r in replies] == [True, True]
        after, versions, _ = pull_rows(c, "big", everything, DIM, torch.float32)
        assert versions == [1, 1]
        assert not torch.equal(after, before)
        for dp, st in shards:
            i = st.job.shard_index
            ref = SparseTable(_spec("big", i))  # the update the pushed gradient makes
            ref.apply(torch.arange(2048), grads[i::2])
            assert torch.equal(st.sparse.tables["big"].weight, ref.weight)
            assert torch.equal(after[i::2], ref.weight)
            stats = dp.stats()
            assert stats["shm"] == (1 if attach else 0), stats
            # "a", then both pulls and the push of "big" through the segment, or none of them
            assert (stats["row_pulls"], stats["row_pushes"]) == ((3, 1) if attach else (1, 0))


# ---- the worker refuses a shard's rows of the wrong size ----------------------------------

Answer = Callable[[socket.socket, bytes], None]


@contextlib.contextmanager
def _fake_shard(answer: Answer, *, shm_ok: bool = False, kind: str = "rows_pull") -> Iterator[int]:
    """A data-plane port that greets one connection (saying it attached the segment where
    `shm_ok`, which it did not) and answers its first call (a frame of `kind`) with
    answer(sock, ids); yields the port. Its own failures are raised here."""
    listener = socket.create_server(("127.0.0.1", 0))
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            conn, _ = listener.accept()
            with conn:
                conn.settimeout(TIMEOUT)
                hello, _ = fr.read_header(conn, max_payload_bytes=0, scratch=fr.Scratch())
                assert hello.WhichOneof("kind") == "hello", hello
                conn.sendall(fr.encode(pb.DataFrame(status=pb.DataStatus(code=0, shm=shm_ok))))
                ask, plen = fr.read_header(conn, max_payload_bytes=1 << 20, scratch=fr.Scratch())
                assert ask.WhichOneof("kind") == kind, ask
                answer(conn, bytes(fr.recv_payload(conn, plen, fr.Scratch())))
                try:  # the worker drops the connection (a reset: our payload unread)
                    assert conn.recv(1) == b""
                except ConnectionResetError:
                    pass
        except BaseException as e:  # noqa: BLE001 - raised in the test's thread
            errors.append(e)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield listener.getsockname()[1]
    finally:
        t.join(TIMEOUT)
        listener.close()
    assert not t.is_alive()
    if errors:
        raise errors[0]


def _rows(nbytes: int, **fields: int) -> Answer:
    """Answer with a DataRows frame and `nbytes` of rows in its payload."""
    return lambda sock, _ids: sock.sendall(
        fr.encode(pb.DataFrame(rows=pb.DataRows(version=3, **fields)), nbytes) + b"\0" * nbytes
    )


WANT = 3 * DIM * 4  # three fp32 rows
REPLIES = {
    "too-few-bytes": (_rows(WANT - 4), False, "the shard sent 92 bytes for 3 rows of 8 (96 bytes)"),
    "too-many-bytes": (_rows(WANT + 4), False, "the shard sent 100 bytes for 3 rows of 8 (96 bytes)"),
    "no-rows": (_rows(0), False, "the shard sent 0 bytes for 3 rows of 8 (96 bytes)"),
    "segment-bytes-without-a-segment": (_rows(0, shm_at=0, shm_bytes=WANT), False, "bad shared-memory rows: no segment on this connection"),
    "segment-bytes-and-a-payload": (_rows(8, shm_at=0, shm_bytes=WANT), True, "bad shared-memory rows: a payload too"),
    "segment-bytes-outside-the-ring": (_rows(0, shm_at=4096 - 8, shm_bytes=WANT), True, "does not lie inside the shared segment's ring"),
    "segment-bytes-ending-at-2**64": (_rows(0, shm_at=(1 << 64) - WANT, shm_bytes=WANT), True, "past the 64-bit position"),
}  # fmt: skip


@pytest.mark.parametrize(("answer", "shm_ok", "words"), list(REPLIES.values()), ids=list(REPLIES))
def test_the_worker_refuses_rows_of_the_wrong_size(
    answer: Answer, shm_ok: bool, words: str
) -> None:
    """sparse_client.pull_rows over a (fake) shard's data plane: rows that are not the
    bytes asked for, or not where the frame says, are INTERNAL naming what is wrong, the
    output untouched by them, the connection dropped."""
    pull = lambda c: pull_rows(c, "t", torch.tensor([5, 0, 9]), DIM, torch.float32)  # noqa: E731
    refused_by_fake_shard(answer, shm_ok, words, pull)


def refused_by_fake_shard(
    answer: Answer, shm_ok: bool, words: str, pull: Callable[[PSClient], object],
    kind: str = "rows_pull",
) -> None:  # fmt: skip
    """pull(client) against a fake shard answering its `kind` call with `answer` fails
    with INTERNAL naming `words`, and the worker drops that connection."""
    cfg = ClientConfig(data_shm_mib=4096 / (1 << 20) if shm_ok else 0)
    with _fake_shard(answer, shm_ok=shm_ok, kind=kind) as port:
        c = PSClient([f"127.0.0.1:{free_port()}"], worker=0, cfg=cfg)  # gRPC: never called
        try:
            c.doors.use_data_port(0, port)
            with pytest.raises(PSClientError) as e:
                pull(c)
            assert e.value.code == SC.INTERNAL, e.value
            assert words in str(e.value), e.value
            dp = c._data[0]
            assert dp is not None and dp._idle == [] and not dp._busy
        finally:
            c.close()


ONE = TableSpec(name="t", rows=64, dim=DIM, lr=0.5)  # the table of a job's only shard


def _only_shard(bind: str, **cfg: Any) -> tuple[Any, int, ShardState]:
    """A real shard, the only one of an async 1-worker job, holding table ONE."""
    srv, port, st = start_server(ServerConfig(bind=bind, threads=4, **cfg))
    job = make_job("async", num_workers=1)
    st.init(job, init_values(job))
    st.sparse.create([ONE])
    return srv, port, st


def test_a_shard_restarted_without_a_data_plane_gets_rows_over_grpc() -> None:
    """A worker that used a shard's data plane, the shard then restarted on its address
    with --data-port -1: the retry asks GetJob, learns there is no data plane, and the
    rows go over gRPC (they used to reach the data-plane code with the gRPC transport:
    AttributeError)."""
    srv, port, _ = _only_shard("127.0.0.1:0")
    c = PSClient([f"127.0.0.1:{port}"], worker=0, cfg=ClientConfig(reconnect_timeout_s=30))
    try:
        c.get_jobs(wait=False)
        pull_rows(c, "t", torch.arange(8), DIM, torch.float32)
        assert srv.psar_dataplane.stats()["row_pulls"] == 1  # the data plane, at first
        stop_server(srv)
        srv, _, st = _only_shard(f"127.0.0.1:{port}", data_port=-1)
        assert srv.psar_dataplane is None
        ids, grads = torch.arange(0, 64, 3), torch.ones(22, DIM)
        [(replies, _)] = push_tables(c, [RowsPush("t", 1, ids, grads, torch.float32, [0])])
        assert [r.applied for r in replies] == [True]
        rows, versions, _ = pull_rows(c, "t", torch.arange(64).flip(0), DIM, torch.float32)
        assert versions == [1]
        assert torch.equal(rows, st.sparse.tables["t"].weight.flip(0))
        ref = SparseTable(ONE)
        ref.apply(ids, grads)
        assert torch.equal(st.sparse.tables["t"].weight, ref.weight)
    finally:
        c.close()
        stop_server(srv)


def test_rows_wait_for_a_restarting_shard_whose_data_port_went_stale() -> None:
    """A rows call failed against a shard that went away (its data port is now stale);
    the next one, made while the shard is still down, waits for it like any call
    (UNAVAILABLE retried, GetJob asked inside the retries) and gets the rows through the
    restarted shard's new data plane. It used to fail at once with the raw gRPC error of
    a GetJob asked outside the retries."""
    srv, port, _ = _only_shard("127.0.0.1:0")
    c = PSClient([f"127.0.0.1:{port}"], worker=0, cfg=ClientConfig(reconnect_timeout_s=0.2))
    back: list[tuple[Any, int, ShardState]] = []
    restart = threading.Timer(0.3, lambda: back.append(_only_shard(f"127.0.0.1:{port}")))
    try:
        c.get_jobs(wait=False)
        pull_rows(c, "t", torch.arange(8), DIM, torch.float32)
        stop_server(srv)
        with pytest.raises(PSClientError) as e:  # no shard for longer than it waits
            pull_rows(c, "t", torch.arange(8), DIM, torch.float32)
        assert e.value.code == SC.UNAVAILABLE
        c.cfg.reconnect_timeout_s = 30.0
        restart.start()
        rows, versions, _ = pull_rows(c, "t", torch.arange(8), DIM, torch.float32)
        restart.join()
        new, _, st = back[0]
        assert versions == [0] and torch.equal(rows, st.sparse.tables["t"].weight[:8])
        assert new.psar_dataplane.stats()["row_pulls"] == 1  # its new data plane
    finally:
        restart.cancel()
        restart.join()
        c.close()
        for s in (srv, *(b[0] for b in back)):
            stop_server(s)
