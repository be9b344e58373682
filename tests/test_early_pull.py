"""Early pulls (ps/server/pulls/early.py): a worker's pull streams while its push still
arrives, slot by slot as the shard applies them; the header comes last and says whether
what came early still holds. Timing changes, never results.

Unit tests drive a --chunk-rounds shard object directly (an early pull in a thread while a
worker streams its push): what a worker assembles from the early pieces and the rest is
exactly what an ordinary pull serves, in the clean case, when an overflow voids the early
pieces, and on a shard that cannot stream early. Real processes: runs with --early-pull,
over the data plane and over gRPC, give the same bits as runs without.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from psar.ps import wire
from psar.ps._gen.psar.v1 import ps_pb2 as pb
from psar.ps.errors import Cancelled, FailedPrecondition
from psar.ps.server.shard import ShardState
from tests.procs import run_ps_workers, shard_stats, shards
from tests.ps_fixtures import grad_for, init_values, make_job, make_state
from tests.test_chunk_rounds import begin, full_push, stream
from tests.test_transport_contract import _FakeTransport

# ---- the shard side ---------------------------------------------------------------------


class EarlyPuller(threading.Thread):
    """Runs one early pull to its end, noting the items in order."""

    def __init__(self, st: ShardState, worker: int, clock: int) -> None:
        super().__init__(daemon=True)
        self.items: list[tuple[Any, ...]] = []
        self.error: BaseException | None = None
        self.gen = st.pulls.pull_early(worker, clock, torch.float32, 30.0)
        self.first = next(self.gen)  # admission happens here: refusals raise now
        self.items.append(self.first)

    def run(self) -> None:
        try:
            self.items.extend(self.gen)
        except BaseException as e:  # noqa: BLE001 - surfaced by the test
            self.error = e

    def assemble(self, like: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
        """Land the items as a worker does: early pieces first, void ones forgotten."""
        out = {k: torch.full_like(v, float("nan")) for k, v in like.items()}
        header, void = None, False
        for item in self.items:
            if item[0] == "header":
                header, void = item[1], item[2]
                if void:
                    for v in out.values():
                        v.fill_(float("nan"))
                continue
            _, key, off, data = item
            piece = wire.decode(data, torch.float32)
            out[key][off : off + piece.numel()] = piece
        return out, header

    def early_count(self) -> int:
        n = 0
        for item in self.items:
            if item[0] == "header":
                return n
            n += 1
        return n


def _served(st: ShardState, worker: int, clock: int) -> dict[str, torch.Tensor]:
    _, pieces = st.pulls.pull(worker, clock, torch.float32, timeout=5.0)
    out = {k: torch.empty_like(m.detach()) for k, m in st.masters.items()}
    for key, off, data in pieces:
        piece = wire.decode(data, torch.float32)
        out[key][off : off + piece.numel()] = piece
    return out


def _start_early(st: ShardState, worker: int, clock: int, grads: dict) -> EarlyPuller:
    """Worker `worker` opens its push of `clock`, streams the last slot, and its early
    pull is started; the first item is that slot's bytes (it was applied early)."""
    t = begin(st, worker, clock)
    last = list(grads)[-1]
    stream(st, t, grads, [last])
    st.policy.quiesce()
    puller = EarlyPuller(st, worker, clock)
    assert puller.first[0] == "piece" and puller.first[1] == last
    puller.start()
    puller.ticket = t  # type: ignore[attr-defined]
    return puller


def test_an_early_pull_sends_slots_before_the_header_and_the_same_weights() -> None:
    job = make_job("sync", optimizer="adamw", num_workers=2)
    st = make_state(job, init_values(job), chunk_rounds=True)
    g0, g1 = grad_for(job, 0, 1), grad_for(job, 1, 1)
    full_push(st, 0, g0)
    p = _start_early(st, 1, 1, g1)
    t = p.ticket  # type: ignore[attr-defined]
    stream(st, t, g1, [k for k in reversed(g1) if k != list(g1)[-1]])
    st.policy.quiesce()
    st.intake.add_verdict(t, False)
    st.intake.finish_push(t)
    t.release()
    p.join(30)
    assert not p.is_alive() and p.error is None
    got, header = p.assemble(st.masters)
    assert header.rounds == 1 and not header.last_round_skipped
    assert p.early_count() >= 1
    assert p.items[-1][0] == "piece" or p.items[-1][0] == "header"
    want = _served(st, 1, 1)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    # Nothing was sent twice: each slot once, early or after the header.
    keys = [i[1] for i in p.items if i[0] == "piece"]
    assert sorted(set(keys)) == sorted(keys) == sorted(st.masters)


def test_an_overflow_voids_the_early_pieces_and_every_slot_follows() -> None:
    job = make_job("sync", optimizer="sgd", num_workers=2)
    st = make_state(job, init_values(job), chunk_rounds=True)
    before = {k: m.detach().clone() for k, m in st.masters.items()}
    full_push(st, 0, grad_for(job, 0, 1))
    g1 = grad_for(job, 1, 1)
    p = _start_early(st, 1, 1, g1)
    t = p.ticket  # type: ignore[attr-defined]
    st.intake.add_verdict(t, True)  # worker 1 overflowed: the round is skipped, early slots undone
    st.intake.finish_push(t)
    t.release()
    p.join(30)
    assert p.error is None
    got, header = p.assemble(st.masters)
    assert header.last_round_skipped
    assert [i[2] for i in p.items if i[0] == "header"] == [True]
    for k in before:
        assert torch.equal(got[k], before[k]), k


def test_an_early_pull_whose_worker_hung_up_stops_waiting() -> None:
    """Worker 1's push failed, so it cut its early pull short: the round will not close with
    it, and the shard thread serving the pull must not wait out the deadline."""
    job = make_job("sync", optimizer="sgd", num_workers=2)
    st = make_state(job, init_values(job), chunk_rounds=True)
    here = threading.Event()
    here.set()
    gen = st.pulls.pull_early(1, 1, torch.float32, 60.0, alive=here.is_set)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            list(gen)
        except BaseException as e:  # noqa: BLE001 - surfaced below
            errors.append(e)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(1.5)
    assert th.is_alive()  # still waiting for slots while the worker is there
    here.clear()  # it hangs up
    th.join(5)
    assert not th.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], Cancelled)
    assert "hung up" in str(errors[0])


def test_an_early_pull_may_name_only_the_clock_being_pushed() -> None:
    job = make_job("sync", optimizer="sgd", num_workers=2)
    st = make_state(job, init_values(job), chunk_rounds=True)
    with pytest.raises(FailedPrecondition, match="early pull may name only"):
        next(st.pulls.pull_early(0, 2, torch.float32, 1.0))


def test_a_shard_without_chunk_rounds_answers_once_the_push_is_in() -> None:
    job = make_job("sync", optimizer="sgd", num_workers=2)
    st = make_state(job, init_values(job))  # whole rounds: nothing to send early
    full_push(st, 0, grad_for(job, 0, 1))
    done: list[Any] = []

    def pull() -> None:
        done.extend(st.pulls.pull_early(1, 1, torch.float32, 30.0))

    th = threading.Thread(target=pull, daemon=True)
    th.start()
    th.join(0.3)
    assert th.is_alive() and not done  # waits for worker 1's own push
    full_push(st, 1, grad_for(job, 1, 1))
    th.join(30)
    assert done[0][0] == "header" and done[0][2] is False
    assert len([i for i in done if i[0] == "piece"]) >= len(st.masters)


# ---- real processes -------------------------------------------------------------------

COMMON = ["--workload", "mlp", "--steps", "10", "--batch-size", "16", "--seed", "7",
          "--lr", "0.05", "--momentum", "0.9", "--precision", "fp32", "--overlap-trial", "0"]  # fmt: skip


# Shards get no flag: per-chunk rounds come with the job (rank 0's --early-pull), except in
# "early-old-shard", the way shards were started before jobs carried it. On one host
# --early-pull's default is off ("ordinary"); rank 1 of "early-rank0" asks for nothing
# and follows the job rank 0 made.
RUNS = {
    "ordinary": ([], []),
    "early": ([], ["--early-pull"]),
    "early-old-shard": (["--chunk-rounds"], ["--early-pull"]),
    "early-no-overlap": ([], ["--early-pull", "--no-overlap"]),
    "early-grpc": ([], ["--early-pull", "--data-plane", "grpc"]),
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "names",
    [
        ("ordinary", "early"),
        pytest.param(
            ("ordinary", "early-old-shard", "early-no-overlap", "early-grpc"),
            marks=pytest.mark.slow,
        ),
    ],
    ids=["overlap", "no-overlap-and-grpc"],
)
def test_early_pulls_give_the_bits_of_ordinary_ones(tmp_path, names) -> None:  # noqa: ANN001
    runs = {n: RUNS[n] for n in names}
    reports, stats = {}, {}
    for name, (server, extra) in runs.items():
        d = tmp_path / name
        d.mkdir()
        with shards(2, *server) as addrs:
            reports[name] = run_ps_workers(
                addrs, 2, d, [*COMMON, *extra, "--save", str(d / "w.pt")]
            )
            stats[name] = shard_stats(addrs)
    # The data plane streamed slots before their rounds closed, and none had to be
    # sent again; gRPC answers early pulls whole (nothing early), as do whole rounds.
    for name in {"early", "early-old-shard", "early-no-overlap"} & runs.keys():
        assert sum(s["early_pull_slots"] for s in stats[name]) > 0, name
        assert sum(s["early_pull_voids"] for s in stats[name]) == 0, name
    for name in {"ordinary", "early-grpc"} & runs.keys():
        assert sum(s["early_pull_slots"] for s in stats[name]) == 0, name
    ref = torch.load(tmp_path / "ordinary" / "w.pt", weights_only=True)
    for name in runs:
        got = torch.load(tmp_path / name / "w.pt", weights_only=True)
        assert all(torch.equal(ref[k], got[k]) for k in ref), name
        for r in range(2):
            assert reports[name][r]["losses"] == reports["ordinary"][r]["losses"], name


def test_early_pulls_are_the_jobs_rank_0_decides_and_the_others_follow(tmp_path) -> None:  # noqa: ANN001
    """No shard flag, rank 1 told --no-early-pull: rank 0's job carries early pulls (and
    the per-chunk rounds they need) to the shards, and rank 1 pulls early too."""
    with shards(1) as addrs:
        reps = run_ps_workers(addrs, 2, tmp_path, COMMON, per_rank={0: ["--early-pull"],
                              1: ["--no-early-pull"]})  # fmt: skip
        stats = shard_stats(addrs)
    assert stats[0]["chunks_applied_early"] > 0 and stats[0]["early_pull_slots"] > 0
    assert "worker 1: early pulls on (the job's)" in (tmp_path / "worker1.log").read_text()
    assert all(len(r["losses"]) == 10 for r in reps)


def test_a_mode_without_per_chunk_rounds_refuses_an_early_pull_job() -> None:
    from psar.ps.errors import InvalidArgument
    from psar.ps.server.modes import BUILTIN

    job = make_job(mode="async", chunk_rounds=True, early_pull=True)
    with pytest.raises(InvalidArgument, match="per-chunk rounds .* --mode async"):
        BUILTIN.serve(job)
    assert BUILTIN.serve(make_job(mode="sync", chunk_rounds=True)).chunk_rounds


def test_early_pull_with_a_mode_not_in_rounds_is_a_flag_error() -> None:
    from psar.trainkit.config import PSConfig

    with pytest.raises(ValueError, match="--early-pull with --mode ssp"):
        PSConfig(mode="ssp", early_pull=True)
    assert PSConfig(mode="ssp").early_pull is None  # auto: off there


# ---- the worker side: the transport contract ----------------------------------------


def _bytes(values: list[float]) -> bytes:
    return torch.tensor(values).numpy().tobytes()


@pytest.mark.parametrize("void", [False, True], ids=["early-holds", "early-void"])
def test_early_pieces_reach_on_piece_only_after_a_header_that_keeps_them(void: bool) -> None:
    out = {"a#0": torch.zeros(2), "b#0": torch.zeros(2)}
    early = [("a#0", 0, _bytes([1.0, 2.0]))]
    rest = [("b#0", 0, _bytes([3.0, 4.0]))]
    if void:
        rest = [("a#0", 0, _bytes([5.0, 6.0])), *rest]
    fake = _FakeTransport(pb.PullHeader(dtype=pb.FLOAT32, early_void=void), rest, early)
    events: list[tuple] = []

    def on_piece(key: str, offset: int, n: int) -> None:
        events.append(("piece", key, out[key].tolist()))

    req = pb.PullRequest(worker=0, clock=1, dtype=pb.FLOAT32, early=True)
    fake.pull(req, out, timeout_s=1.0, on_piece=on_piece,
              on_header=lambda h: events.append(("header",)))  # fmt: skip
    if void:  # the early copy of a#0 never reaches on_piece; its resend does
        assert events == [("header",), ("piece", "a#0", [5.0, 6.0]), ("piece", "b#0", [3.0, 4.0])]
    else:  # replayed just before the header, then the rest
        assert events == [("piece", "a#0", [1.0, 2.0]), ("header",), ("piece", "b#0", [3.0, 4.0])]
