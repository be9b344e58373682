"""A bounded hostile-input campaign against a real `psar server` process, both doors (#18).

Each test starts a real shard process, initialises it as rank 0 does (PSClient.init), and
hammers it: mutated gRPC push / pull / Init streams, mutated data-plane frame streams,
slow senders, oversize length claims, connection floods (those: test_hostile_conns.py).
tests/hostile.py keeps an in-process mirror of the shard that runs every request too, so
after EVERY request the two agree: a refused one left the state digest unchanged, an
accepted one changed it exactly as on the mirror. Control pushes through the worker's own
client (both doors) must land as expected, the shard must stay alive and keep serving a
fresh worker's pull bit for bit.

Every test prints one line: requests tried, crashes, state changes behind an error,
peak shard RSS. Seeds and counts are fixed; `-m slow` runs the full campaign, the
unmarked smoke test a small one.
"""

from __future__ import annotations

import random
import socket
import time
from pathlib import Path

import grpc
import pytest
import torch

from psar.ps import auth
from psar.ps import framing as fr
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps._gen.psar.v1 import ps_pb2_grpc as pb_grpc
from psar.ps.wire import iter_pieces
from tests import hostile as h
from tests import hostile_wire as w
from tests.ps_fixtures import init_chunks
from tests.test_security import certs  # noqa: F401 - the fixture

SC = grpc.StatusCode


# ---- one request, checked against the mirror ------------------------------------------


class Campaign:
    def __init__(self, s: h.HostileShard, name: str, seed: int) -> None:
        self.s = s
        self.t = h.Tally(name)
        self.rng = random.Random(seed)
        self.m = w.Mutator(seed, s.incarnation)
        self.last = s.trace()
        path = "/psar.v1.ParameterServer/"
        ch = s.channel
        self.push_call = ch.stream_unary(path + "Push", request_serializer=h._identity,
                                         response_deserializer=pb.PushReply.FromString)  # fmt: skip
        self.init_call = ch.stream_unary(path + "Init", request_serializer=h._identity,
                                         response_deserializer=pb.InitReply.FromString)  # fmt: skip
        self.pull_call = ch.unary_stream(path + "Pull", request_serializer=h._identity,
                                         response_deserializer=pb.PullChunk.FromString)  # fmt: skip

    def check(self, what: str, code: SC | None, shard_ok: bool, mirror_ok: bool) -> None:
        """After one request: crashes, traces behind errors, agreement with the mirror."""
        t, s = self.t, self.s
        t.tried += 1
        t.code(code)
        tracebacks = s.new_tracebacks()
        if code == SC.UNKNOWN or not s.alive() or tracebacks:
            t.crashes += 1  # one per request: UNKNOWN is an unhandled exception somewhere
            t.note(f"crash after {what}: {code} {tracebacks[:1]}")
        if not s.alive():
            raise AssertionError(f"the shard died after {what}:\n{s.proc.output()[-3000:]}")
        after = s.trace()
        if shard_ok:
            t.accepted += 1
        else:
            t.refused += 1
            if after != self.last:
                t.behind_error += 1
                t.note(f"state changed behind {code} after {what}")
        if shard_ok != mirror_ok or after != s.mirror_trace():
            t.divergences += 1
            t.note(f"mirror disagrees after {what}: shard ok={shard_ok} code={code}, "
                   f"mirror ok={mirror_ok}")  # fmt: skip
        self.last = after

    # -- gRPC ------------------------------------------------------------------------

    def grpc_push(self) -> None:
        raw, done = self.m.push_stream(h.valid_push(self.s, self.rng.randrange(2), self.rng))
        code = _code(lambda: self.push_call(iter(raw), timeout=h.TIMEOUT))
        ok = code is None
        if not ok:
            time.sleep(0.02)  # a handler that misbehaves after its error gets a moment
        self.check(f"gRPC push {done}", code, ok, w.replay_grpc_push(self.s.mirror, raw))

    def grpc_pull(self) -> None:
        r = self.rng
        req = pb.PullRequest(
            worker=r.choice([0, 1, 1, 2, 2**32 - 1]), clock=r.choice([0, 1, *w.U64]),
            dtype=r.choice([0, 1, 2, 3, 4, 99]),
            incarnation=r.choice([0, self.s.incarnation, self.s.incarnation ^ 1]),
        ).SerializeToString()  # fmt: skip
        # (Undecodable unary requests: test_undecodable_unary_requests_get_a_status.)
        code = _code(lambda: list(self.pull_call(req, timeout=h.TIMEOUT)))
        self.check("gRPC pull", code, code is None, code is None)  # a pull changes nothing

    def grpc_init(self) -> None:
        chunks = init_chunks(self.s.job, self.s.values, message_bytes=4096)
        raw, done = self.m.push_stream(chunks)  # the same mutations fit an Init stream
        code = _code(lambda: self.init_call(iter(raw), timeout=h.TIMEOUT))
        self.check(f"gRPC init {done}", code, code is None, code is None)  # never changes

    # -- data plane --------------------------------------------------------------------

    def data_push(self) -> None:
        frames = w.push_frames(h.valid_push(self.s, self.rng.randrange(2), self.rng), self.s.token)
        data, done = w.mutate_frames(self.m, frames)
        replies = self.s.exchange(data)
        code = h.refusal(replies)
        ok = any(f.HasField("push_reply") for f in replies)
        if not ok:
            time.sleep(0.02)
        mirror_ok = w.replay_data_plane(self.s.mirror, data, self.s.token) > 0
        self.check(f"data-plane push {done}", code, ok, mirror_ok)

    def data_pull(self) -> None:
        r = self.rng
        req = pb.DataPullRequest(
            request=pb.PullRequest(worker=r.choice([0, 1, 2]), clock=r.choice([0, 1, 2**63]),
                                   dtype=r.choice([0, 1, 2, 3, 7]),
                                   incarnation=r.choice([0, self.s.incarnation, 5])),
            timeout_s=r.choice([0.0, 1.0, float("inf"), float("nan"), -1.0, 1e10, 1e300]),
        )  # fmt: skip
        hello = w.hello_frame(token=self.s.token)
        data = w.encode_frames([hello, (pb.DataFrame(pull_request=req), b"")])
        replies = self.s.exchange(data)
        code = h.refusal(replies)
        ok = any(f.HasField("pull_header") for f in replies)
        if not ok and code is None:
            code = SC.UNKNOWN  # a pull answered by neither a header nor a status
        self.check("data-plane pull", code, ok, ok)

    # -- a real worker -----------------------------------------------------------------

    def control(self, worker: int, door: str) -> None:
        """A valid push through the worker's own client: it must land exactly as on the
        mirror (version + 1 and the mirror's digest), never be refused."""
        s = self.s
        worker = s.fresh_worker(worker)
        clock, version = s.next_push(worker)
        dtype, scale = s.round_wire()
        # Values that fit fp16 whatever the round's scale (an accepted fuzzed push may
        # have set one as large as 1e300): gradients of tiny magnitude, finite on the wire.
        fits = min(scale, 1024.0)
        grads = {k: (t * fits).to(dtype) for k, t in h.gradient(s.job, self.rng).items()}
        with s.client(worker, door) as c:
            c.get_jobs(wait=False)
            (reply,) = c.push(clock=clock, base_versions=[version], dtype=dtype, grads=grads,
                              loss_scale=scale)  # fmt: skip
        head = pb.PushHeader(worker=worker, clock=clock, base_version=version,
                             dtype=h.WIRE_OF[dtype], loss_scale=scale)  # fmt: skip
        items = [("piece", pb.TensorData(key=k, offset=0), t.numpy().tobytes())
                 for k, t in grads.items()]  # fmt: skip
        assert w.replay_push(s.mirror, head, items)
        self.t.tried += 1
        after = s.trace()
        assert reply.applied and reply.version == s.mirror.version, reply
        assert after == s.mirror_trace() and after[0] != self.last[0], f"control via {door}"
        self.last = after

    def fresh_worker_pull(self, door: str) -> None:
        """A fresh worker pulls every weight: bit for bit the mirror's masters."""
        s = self.s
        out = {sl.key: torch.full((sl.numel,), float("nan")) for sl in s.job.slots}
        with s.client(1, door) as c:
            c.get_jobs(wait=False)
            c.pull(clock=s.pull_clock(1), dtype=torch.float32, out=out)
        self.t.tried += 1
        for key, p in s.mirror.masters.items():
            assert torch.equal(out[key], p.detach()), f"{key} differs from the mirror ({door})"

    def finish(self) -> h.Tally:
        """The summary line; then (if the mirror still follows) a real worker's pushes
        and a fresh worker's pulls through both doors."""
        self.t.peak_rss_mib = self.s.peak_rss_mib()
        print(self.t.line())
        for n in self.t.notes:
            print("  ", n)
        if not self.t.divergences:
            for door in ("tcp", "grpc"):
                self.control(0, door)
                self.fresh_worker_pull(door)
        return self.t


def _code(fn) -> SC | None:  # noqa: ANN001
    try:
        fn()
        return None
    except grpc.RpcError as e:
        return e.code()


def assert_clean(t: h.Tally) -> None:
    assert (t.crashes, t.behind_error, t.divergences) == (0, 0, 0), t.notes


def run_fuzz(s: h.HostileShard, name: str, seed: int, n: int, weights: dict[str, int]) -> h.Tally:
    c = Campaign(s, name, seed)
    kinds = [k for k, w in weights.items() for _ in range(w)]
    for i in range(n):
        getattr(c, c.rng.choice(kinds))()
        if c.t.divergences:
            break  # the mirror no longer follows: later checks would mean nothing
        if i % 50 == 49:
            c.control(c.rng.randrange(2), c.rng.choice(["tcp", "grpc"]))
    return c.finish()


GRPC_MIX = {"grpc_push": 8, "grpc_pull": 1, "grpc_init": 1}
DATA_MIX = {"data_push": 9, "data_pull": 1}


# ---- the smoke variant (fast) ------------------------------------------------------------


def test_hostile_smoke_both_doors(tmp_path: Path) -> None:
    """~20 s: a small campaign over both doors, a 20-connection flood, a fresh worker."""
    with h.hostile_shard(tmp_path) as s:
        mix = {**GRPC_MIX, **DATA_MIX}
        t = run_fuzz(s, "smoke", seed=18, n=120, weights=mix)
        assert_clean(t)
        assert t.refused > 40 and t.accepted > 0  # the mutations do reach both outcomes
        socks = _flood_data_plane(s, 20, random.Random(1))
        Campaign(s, "smoke-flood", 2).control(1, "grpc")
        for sock in socks:
            sock.close()


def test_refused_first_pushes_leave_an_exact_round_open_to_any_dtype(tmp_path: Path) -> None:
    """Issue #36 item 3, shrunk from the sync campaign (seed 1809): the first push of a
    sync round, fp16 into the exact sum, is refused mid-stream (gRPC: a piece at the
    wrong offset), cut before its end (data plane), or refused at its header (another loss
    scale than the shard's). Each must leave no trace, also not the round's dtype or scale:
    the workers' fp32 pushes that follow land as on the mirror (before the fix:
    FAILED_PRECONDITION, "sums fp16 gradients exactly")."""
    with h.hostile_shard(tmp_path, mode="sync", exact_fp16_sum=True) as s:
        c = Campaign(s, "exact-first-refused", 36)
        ours = 1.0  # the shard's loss scale (the job scales no loss)
        for scale, door, want in ((ours, "grpc", SC.INVALID_ARGUMENT), (ours, "tcp", None),
                                  (8.0, "tcp", SC.FAILED_PRECONDITION)):  # fmt: skip
            head = pb.PushHeader(worker=1, clock=1, base_version=0, dtype=pb.FLOAT16,
                                 loss_scale=scale, incarnation=s.incarnation)  # fmt: skip
            chunks = [pb.PushChunk(header=head)]
            for key, t in h.gradient(s.job, c.rng).items():
                flat = (t * scale).half()
                for off, data in iter_pieces(flat, h.PIECE_BYTES):
                    chunks.append(pb.PushChunk(data=pb.TensorData(key=key, offset=off, data=data)))
            if door == "grpc":
                chunks[-1].data.offset += 1  # refused there, the slots before it summed
                raw = [m.SerializeToString() for m in chunks]
                code = _code(lambda raw=raw: c.push_call(iter(raw), timeout=h.TIMEOUT))
            else:
                frames = w.push_frames(chunks, s.token)
                if want is None:
                    frames = frames[:-1]  # every slot, then no end
                code = h.refusal(s.exchange(w.encode_frames(frames)))
            assert code == want, (scale, door, code)
            c.check(f"fp16 push via {door} at scale {scale} not accepted", code, False, False)
        c.control(0, "grpc")  # fp32: round 1 sums in rank order after all
        c.control(1, "tcp")
        assert s.mirror.version == 1
        assert_clean(c.t)


@pytest.mark.slow
@pytest.mark.parametrize("wire", ["tls", "sealed"])
def test_hostile_smoke_secured_wires(tmp_path: Path, certs: Path, wire: str) -> None:  # noqa: F811
    """Issue #33: the same campaign against a TLS shard, every data-plane request in
    standard TLS records (the default) or in sealed records after its hello (the opt-in
    --data-sealed-records); the control worker's connections use the same wire."""
    with h.hostile_shard(tmp_path, certs=certs, sealed=wire == "sealed") as s:
        t = run_fuzz(s, f"smoke-{wire}", seed=33, n=80, weights={**GRPC_MIX, **DATA_MIX})
        assert_clean(t)
        assert t.refused > 20 and t.accepted > 0
        assert (s.sealed_exchanges > 20) == (wire == "sealed"), s.sealed_exchanges


# ---- the full campaign (slow) --------------------------------------------------------------


@pytest.mark.slow
def test_hostile_grpc_fuzz(tmp_path: Path) -> None:
    with h.hostile_shard(tmp_path) as s:
        assert_clean(run_fuzz(s, "grpc-fuzz", seed=1801, n=1500, weights=GRPC_MIX))


@pytest.mark.slow
@pytest.mark.parametrize("exact", [True, False], ids=["exact-fp16-sum", "rank-order"])
def test_hostile_sync_fuzz_both_doors(tmp_path: Path, exact: bool) -> None:
    """Sync rounds (pushes held until both workers' are in, verdicts that skip a round):
    pushes and Inits only, since a sync pull at a later clock waits by design. fp16
    rounds summed exactly as they arrive (the default) and in rank order
    (--no-exact-fp16-sum); seed 1809 found a refused push deciding how its round sums
    (issue #36)."""
    with h.hostile_shard(tmp_path, mode="sync", exact_fp16_sum=exact) as s:
        mix = {"grpc_push": 5, "grpc_init": 1, "data_push": 5}
        assert_clean(run_fuzz(s, "sync-fuzz", seed=1809, n=1000, weights=mix))


@pytest.mark.slow
def test_hostile_token_shard(tmp_path: Path) -> None:
    """A shard with --auth-token-file: the data-plane campaign with the right token in
    valid hellos (mutations drop it, cut it, lengthen it), and gRPC calls without the
    token or with a wrong one: UNAUTHENTICATED, never a bypass, nothing changes."""
    with h.hostile_shard(tmp_path, token="s3cret-hostile-token") as s:
        c = Campaign(s, "token-shard", 1811)
        for i in range(40):
            token = ["", "wrong", "s3cret"][i % 3]
            code = _call_with_token(s, token, i % 3, h.valid_push(s, 1, c.rng))
            c.check(f"a call with token {token!r}", code, False, False)
            assert code == SC.UNAUTHENTICATED, code
        assert_clean(run_fuzz(s, "token-shard", seed=1811, n=600, weights=DATA_MIX))


def _call_with_token(s: h.HostileShard, token: str, which: int, chunks: list) -> SC | None:
    """A valid push, a Stats or a Leave carrying `token`; the status it got."""
    with auth.make_channel(s.address, [], token=token) as ch:
        stub = pb_grpc.ParameterServerStub(ch)
        if which == 0:
            return _code(lambda: stub.Push(iter(chunks), timeout=h.TIMEOUT))
        if which == 1:
            return _code(lambda: stub.Stats(pb.StatsRequest(), timeout=h.TIMEOUT))
        return _code(lambda: stub.Leave(pb.LeaveRequest(worker=0), timeout=h.TIMEOUT))


@pytest.mark.slow
def test_hostile_data_plane_fuzz(tmp_path: Path) -> None:
    with h.hostile_shard(tmp_path) as s:
        assert_clean(run_fuzz(s, "data-plane-fuzz", seed=1802, n=1500, weights=DATA_MIX))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("wire", ["tls", "sealed"])
def test_hostile_secured_wires_fuzz(tmp_path: Path, certs: Path, mode: str, wire: str) -> None:  # noqa: F811
    """The data-plane campaign over a TLS shard, async and sync: in standard TLS records
    (the default: Python's SSLSocket at both ends)
    and in sealed records (--data-sealed-records)."""
    mix = DATA_MIX if mode == "async" else {"grpc_push": 2, "data_push": 8}
    sealed = wire == "sealed"
    with h.hostile_shard(tmp_path, mode=mode, certs=certs, sealed=sealed) as s:
        assert_clean(run_fuzz(s, f"{wire}-fuzz-{mode}", seed=3303, n=500, weights=mix))
        assert (s.sealed_exchanges > 100) == sealed, s.sealed_exchanges


def _flood_data_plane(s: h.HostileShard, n: int, rng: random.Random) -> list[socket.socket]:
    """`n` data-plane connections left open: silent, hello only, half a prefix, or a
    refused push whose piece then never comes. Each may be refused (a per-peer cap)."""
    refused_head = pb.DataFrame(push_header=pb.PushHeader(worker=99, dtype=pb.FLOAT32,
                                                          loss_scale=1.0))  # fmt: skip
    opening = [
        b"",
        w.encode_frames([w.hello_frame()]),
        fr.MAGIC + b"\x10",
        w.encode_frames([w.hello_frame(), (refused_head, b"")])
        + fr.encode(pb.DataFrame(piece=pb.DataPiece(key="fc2.bias#0")), 1024),
    ]
    socks = []
    for i in range(n):
        try:
            sock = h.data_conn(s.data_port)
            socks.append(sock)
            sock.sendall(opening[(i + rng.randrange(4)) % 4])
        except OSError:
            pass
    return socks
