"""One contract, two doors: the same pushes and pulls through the gRPC transport
(ps/client/grpc_transport.py) and the TCP data plane (ps/client/tcp_transport.py) against
real shards on loopback, with the same results (bytes, replies, headers, piece
callbacks), the same refusals (code and words), the same client-side checks (push items,
bounds of received pieces) and the same cancellation.

Most refusals run against ONE shard reached through both of its doors: whatever one
door refuses, the other refuses with the same code and details, and neither changes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from psar.ps import serde
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.client.grpc_transport import GrpcTransport
from psar.ps.client.psclient import ClientConfig, PSClient
from psar.ps.client.tcp_transport import DataPlaneClient
from psar.ps.client.transport import PullStream, Transport, TransportError
from psar.ps.job import Job
from psar.ps.partition import plan_slots
from tests.ps_fixtures import PARAMS, grad_for, make_job, without_speculation
from tests.test_dataplane import MAX_MESSAGE, TIMEOUT, Shard, header, items, shard

SC = grpc.StatusCode
DOORS = ("grpc", "tcp")
PIECE_BYTES = 12  # 3 fp32 elements: every slot (8, 4 and 5 elements) is cut up


def door(s: Shard, kind: str, piece_bytes: int = PIECE_BYTES) -> Transport:
    if kind == "grpc":
        return GrpcTransport(lambda: s.stub, f"127.0.0.1:{s.port}", piece_bytes=piece_bytes)
    return DataPlaneClient("127.0.0.1", s.data_port, max_frame_bytes=piece_bytes)


def buffers(job: Job, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    return {s.key: torch.full((s.numel,), float("nan"), dtype=dtype) for s in job.slots}


def pull(t: Transport, job: Job, worker: int, clock: int, **kw: Any) -> tuple[Any, dict, list]:
    """A pull through the contract; (header, weights, [(event, ...)] in order)."""
    dtype = kw.pop("out_dtype", torch.float32)
    req = pb.PullRequest(worker=worker, clock=clock, dtype=kw.pop("dtype", pb.FLOAT32))
    out = kw.pop("out", None) or buffers(job, dtype)
    events: list[tuple] = []
    head = t.pull(
        req,
        out,
        timeout_s=TIMEOUT,
        on_open=lambda _s: events.append(("open",)),
        on_header=lambda h: events.append(("header", h.version)),
        on_piece=lambda *a: events.append(("piece", *a)),
        **kw,
    )
    return head, out, events


# ---- same bytes -----------------------------------------------------------------------


@pytest.mark.parametrize(("mode", "dtype"), [("sync", pb.FLOAT32), ("async", pb.BFLOAT16)])
def test_both_doors_leave_identical_shards_and_pull_identical_bytes(mode: str, dtype: int) -> None:
    """Two workers, three clocks (one streamed push with its verdict in the middle): a
    shard fed through gRPC and one fed through the data plane end byte-identical, and
    every pull gives the same header, bytes and piece callbacks in the same order."""
    job = make_job(mode, num_workers=2, optimizer="adamw")
    tdt = serde.dtype_from_pb(dtype)
    with shard(job) as a, shard(job) as b:
        ta, tb = door(a, "grpc"), door(b, "tcp")
        versions = {0: 0, 1: 0}
        for clock in (1, 2, 3):
            for w in (0, 1):
                streamed = clock == 2 and w == 1
                h = header(w, clock, versions[w], dtype=dtype, verdict_follows=streamed)
                its = items(grad_for(job, w, clock), tdt)
                if streamed:  # the verdict arrives before the last pieces
                    its.insert(1, ("verdict", False))
                ra = ta.push(h, its, timeout_s=TIMEOUT)
                rb = tb.push(h, its, timeout_s=TIMEOUT)
                assert (ra.applied, ra.version, ra.staleness) == (
                    rb.applied,
                    rb.version,
                    rb.staleness,
                )
            for w in (0, 1):
                ha, wa, ea = pull(ta, job, w, clock, dtype=dtype, out_dtype=tdt)
                hb, wb, eb = pull(tb, job, w, clock, dtype=dtype, out_dtype=tdt)
                assert (ha.version, ha.rounds, ha.loss_scale, ha.dtype) == (
                    hb.version,
                    hb.rounds,
                    hb.loss_scale,
                    hb.dtype,
                )
                assert ea == eb and ea[:2] == [("open",), ("header", ha.version)]
                for k in wa:
                    assert torch.equal(wa[k], wb[k]), k
                versions[w] = hb.version
        assert a.state.state_digest() == b.state.state_digest()
        tb.close()


@pytest.mark.parametrize("kind", DOORS)
def test_pull_converts_on_copy_and_reports_pieces_that_tile_each_slot(kind: str) -> None:
    job = make_job("async", num_workers=1)
    with shard(job) as s:
        t = door(s, kind)
        _, out, events = pull(t, job, 0, 0, out_dtype=torch.float16)
        for key, p in s.state.masters.items():
            assert torch.equal(out[key], p.detach().to(torch.float16))
        ends = {sl.key: 0 for sl in job.slots}
        for _, key, offset, n in events[2:]:
            assert offset == ends[key]  # in order, no gap, no overlap
            ends[key] += n
        assert ends == {sl.key: sl.numel for sl in job.slots}
        t.close()


# ---- same refusals --------------------------------------------------------------------


def g1(job: Job, **edits: torch.Tensor) -> list[tuple]:
    g = grad_for(job, 1, 1)
    g.update(edits)
    return items(g)


def pushing(h: pb.PushHeader, its: Callable[[Job], list]) -> Callable[[Transport, Job], Any]:
    return lambda t, job: t.push(h, its(job), timeout_s=TIMEOUT)


def pulling(worker: int, clock: int, dtype: int = pb.FLOAT32) -> Callable[[Transport, Job], Any]:
    return lambda t, job: pull(t, job, worker, clock, dtype=dtype)


REFUSALS: list[tuple[str, Callable[[Transport, Job], Any], grpc.StatusCode, str]] = [
    ("unknown-key", pushing(header(1, 1), lambda j: [("data", "nope#0", 0, torch.zeros(2))]), SC.NOT_FOUND, "nope#0"),
    ("piece-at-wrong-offset", pushing(header(1, 1), lambda j: [("data", "b#0", 2, torch.zeros(2))]), SC.INVALID_ARGUMENT, "expected 0"),
    ("too-many-elements", pushing(header(1, 1), lambda j: g1(j, **{"b#0": torch.zeros(6)})), SC.INVALID_ARGUMENT, "holds 5"),
    ("incomplete-push", pushing(header(1, 1), lambda j: g1(j)[:-1]), SC.INVALID_ARGUMENT, "incomplete"),
    ("verdict-never-came", pushing(header(1, 1, verdict_follows=True), g1), SC.INVALID_ARGUMENT, "verdict"),
    ("verdict-not-announced", pushing(header(1, 1), lambda j: [*g1(j), ("verdict", False)]), SC.INVALID_ARGUMENT, "verdict_follows"),
    ("two-verdicts", pushing(header(1, 1, verdict_follows=True), lambda j: [("verdict", False), ("verdict", False)]), SC.INVALID_ARGUMENT, "one verdict"),
    ("duplicate-push", pushing(header(0, 1), lambda j: items(grad_for(j, 0, 1))), SC.FAILED_PRECONDITION, "duplicate"),
    ("out-of-order-clock", pushing(header(1, 2), g1), SC.FAILED_PRECONDITION, "out-of-order"),
    ("unknown-worker", pushing(header(2, 1), g1), SC.INVALID_ARGUMENT, "not in this job"),
    ("stale-incarnation", pushing(header(1, 1, incarnation=12345), g1), SC.ABORTED, "restored"),
    ("nan-in-sync", pushing(header(1, 1), lambda j: g1(j, **{"b#0": torch.full((5,), float("nan"))})), SC.INVALID_ARGUMENT, "non-finite"),
    ("pull-ahead-of-own-clock", pulling(1, 1), SC.FAILED_PRECONDITION, "pushed only 0"),
    ("pull-dtype-unknown", pulling(0, 0, dtype=9), SC.INVALID_ARGUMENT, "dtype"),
    ("pull-unknown-worker", pulling(7, 0), SC.INVALID_ARGUMENT, "worker 7"),
]  # fmt: skip


@pytest.fixture(scope="module")
def ready() -> Iterator[Shard]:
    """Sync, 2 workers, AdamW; worker 0 pushed clock 1, worker 1 not (the round waits)."""
    job = make_job("sync", num_workers=2, optimizer="adamw")
    with shard(job) as s:
        t = door(s, "grpc")
        assert t.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT).version == 0
        yield s


def refusal(t: Transport, job: Job, request: Callable[[Transport, Job], Any]) -> tuple[Any, str]:
    with pytest.raises(grpc.RpcError) as e:
        request(t, job)
    return e.value.code(), e.value.details()


@pytest.mark.parametrize(
    ("request_fn", "code", "words"), [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS]
)
def test_both_doors_refuse_alike_and_change_nothing(ready: Shard, request_fn, code, words) -> None:  # noqa: ANN001
    before = without_speculation(ready.state.stats())
    doors = {kind: door(ready, kind) for kind in DOORS}
    got = {kind: refusal(t, ready.job, request_fn) for kind, t in doors.items()}
    assert got["grpc"] == got["tcp"], got
    assert got["grpc"][0] == code and words in got["grpc"][1], got
    assert without_speculation(ready.state.stats()) == before, "a refused request changed it"
    for t in doors.values():
        t.close()


@pytest.mark.parametrize("kind", DOORS)
def test_a_piece_over_the_shards_limit_is_resource_exhausted(ready: Shard, kind: str) -> None:
    """Each door's own size limit (gRPC's message limit, the frame limit): same code."""
    before = without_speculation(ready.state.stats())
    big = g1(ready.job, **{"b#0": torch.zeros(MAX_MESSAGE // 4 + 1)})
    t = door(ready, kind, piece_bytes=1 << 20)
    code, _ = refusal(t, ready.job, pushing(header(1, 1), lambda _j: big))
    assert code == SC.RESOURCE_EXHAUSTED
    assert without_speculation(ready.state.stats()) == before
    t.close()


# ---- the client's own checks ----------------------------------------------------------


BAD_ITEMS: list[tuple[str, list[tuple], str]] = [
    ("unknown-kind", [("gradient", "b#0", 0, torch.zeros(5))], "('data', ...) or ('verdict', ...)"),
    ("wrong-dtype", [("data", "b#0", 0, torch.zeros(5, dtype=torch.float16))], "header's dtype"),
    ("not-contiguous", [("data", "b#0", 0, torch.zeros(10)[::2])], "contiguous"),
]  # fmt: skip


@pytest.mark.parametrize("kind", DOORS)
@pytest.mark.parametrize(
    ("bad", "words"), [c[1:] for c in BAD_ITEMS], ids=[c[0] for c in BAD_ITEMS]
)
def test_bad_push_items_raise_the_same_value_error(ready: Shard, kind: str, bad, words) -> None:  # noqa: ANN001
    before = without_speculation(ready.state.stats())
    t = door(ready, kind)
    its = [*g1(ready.job)[:1], *bad]  # a good piece first: the stream is already open
    with pytest.raises(ValueError, match="push") as e:
        t.push(header(1, 1), its, timeout_s=TIMEOUT)
    assert words in str(e.value)
    assert without_speculation(ready.state.stats()) == before
    t.close()


def _after_address(details: str) -> str:
    return details.split(": ", 1)[1]  # "pull from HOST:PORT: ..." names the door's port


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda out: out.pop("b#0"), "no destination buffer has that key"),
        (lambda out: out.update({"w#0": torch.zeros(7)}), "past the slot's 7 elements"),
    ],
    ids=["unknown-key", "slot-too-short"],
)
def test_received_pieces_are_bounds_checked_alike(ready: Shard, edit, words) -> None:  # noqa: ANN001
    """A piece that does not fit the caller's buffers is INTERNAL before a byte of it
    lands; the door stays usable."""
    got = {}
    for kind in DOORS:
        t = door(ready, kind)
        out = buffers(ready.job)
        edit(out)
        code, details = refusal(t, ready.job, lambda t, job: pull(t, job, 0, 0, out=out))  # noqa: B023
        assert code == SC.INTERNAL and "does not fit the destination buffers" in details
        assert words in details
        got[kind] = _after_address(details)
        head, _, _ = pull(t, ready.job, 0, 0)  # the same door serves the next pull
        assert head.version == 0
        t.close()
    assert got["grpc"] == got["tcp"]


def _piece(key: str, offset: int, data: bytes) -> Any:
    piece = type("P", (), {"key": key, "offset": offset, "nbytes": len(data)})()
    piece.read = lambda: data
    piece.read_into = lambda view: view.__setitem__(slice(None), data)
    return piece


class _FakeTransport(Transport):
    """A transport whose shard misbehaves: the contract's checks of what comes back."""

    address = "fake:1"

    def __init__(
        self,
        head: pb.PullHeader,
        pieces: list[tuple[str, int, bytes]],
        early: list[tuple[str, int, bytes]] | None = None,
    ) -> None:
        """`early`: pieces an early pull sends before `head` (tests/test_early_pull.py)."""
        self.head, self.pieces, self.early = head, pieces, list(early or [])

    @property
    def piece_bytes(self) -> int:
        return 4

    def send_push(self, header, parts, *, timeout_s):  # noqa: ANN001, ANN201
        raise NotImplementedError

    def open_pull(self, req: pb.PullRequest, *, timeout_s: float) -> PullStream:
        fake = self

        class _Stream(PullStream):
            def header(self) -> pb.PullHeader:
                return fake.head

            def next_piece(self) -> Any:
                return _piece(*fake.pieces.pop(0)) if fake.pieces else None

            def next_early(self) -> Any:
                # Without early pieces: a shard that does not stream early, header first.
                return _piece(*fake.early.pop(0)) if fake.early else fake.head

            def cancel(self) -> None: ...

            def close(self) -> None: ...

        return _Stream()

    def cancel_all(self) -> None: ...

    def close(self) -> None: ...


@pytest.mark.parametrize(
    ("head", "pieces", "words"),
    [
        (pb.PullHeader(dtype=9), [], "dtype 9"),
        (pb.PullHeader(dtype=pb.FLOAT32), [("b#0", 0, b"\0" * 7)], "whole number of 4-byte"),
        (pb.PullHeader(dtype=pb.FLOAT32), [("b#0", 4, b"\0" * 8)], "ends at 6"),
    ],
    ids=["unknown-dtype", "partial-element", "past-the-end"],
)
def test_what_a_shard_sends_back_is_checked(head, pieces, words) -> None:  # noqa: ANN001
    out = {"b#0": torch.zeros(5)}
    with pytest.raises(TransportError) as e:
        _FakeTransport(head, pieces).pull(pb.PullRequest(), out, timeout_s=1)
    assert e.value.code() == SC.INTERNAL and words in e.value.details()
    assert torch.equal(out["b#0"], torch.zeros(5)), "a byte landed"


# ---- waiting and cancelling -----------------------------------------------------------


@pytest.mark.parametrize("kind", DOORS)
def test_a_waiting_pull_is_cancelled_through_its_stream(kind: str) -> None:
    import threading

    job = make_job("sync", num_workers=2)
    with shard(job) as s:
        t = door(s, kind)
        t.push(header(0, 1), items(grad_for(job, 0, 1)), timeout_s=TIMEOUT)
        opened: list[PullStream] = []
        errors: list[BaseException] = []
        is_open = threading.Event()

        def waiting() -> None:
            try:  # waits for worker 1, who never pushes
                t.pull(
                    pb.PullRequest(worker=0, clock=1, dtype=pb.FLOAT32),
                    buffers(job),
                    timeout_s=TIMEOUT,
                    on_open=lambda st: (opened.append(st), is_open.set()),
                )
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        th = threading.Thread(target=waiting)
        th.start()
        assert is_open.wait(TIMEOUT)
        opened[0].cancel()
        th.join(TIMEOUT)
        assert not th.is_alive()
        (e,) = errors
        assert isinstance(e, grpc.RpcError) and e.code() == SC.CANCELLED
        t.push(header(1, 1), items(grad_for(job, 1, 1)), timeout_s=TIMEOUT)
        assert pull(t, job, 0, 1)[0].version == 1  # the shard and the door carry on
        t.close()


# ---- the worker's client over either door ---------------------------------------------


def test_psclient_gets_the_same_results_over_either_data_plane() -> None:
    job = make_job("sync", num_workers=1, optimizer="adamw")
    results = []
    for plane in DOORS:
        with shard(job) as s:
            cfg = ClientConfig(timeout_s=TIMEOUT, pull_timeout_s=TIMEOUT, data_plane=plane)
            with PSClient([f"127.0.0.1:{s.port}"], worker=0, cfg=cfg) as c:
                c.set_slots(plan_slots(PARAMS, 1, chunk_bytes=32))
                assert c.get_jobs(wait=True) == [job]
                used = c.doors.transport(0)
                assert isinstance(used, GrpcTransport if plane == "grpc" else DataPlaneClient)
                replies = [
                    c.push(clock=k, base_versions=[k - 1], dtype=torch.float32, grads=grad_for(job, 0, k))[0]
                    for k in (1, 2)
                ]  # fmt: skip
                out = buffers(job)
                [head] = c.pull(clock=2, dtype=torch.float32, out=out)
            results.append(
                ([(r.applied, r.version) for r in replies], head, out, s.state.state_digest())
            )
    (ra, ha, wa, da), (rb, hb, wb, db) = results
    assert ra == rb == [(True, 1), (True, 2)] and ha == hb and da == db
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
