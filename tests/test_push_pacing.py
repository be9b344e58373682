"""Push pacing (ps/server/intake/pacing.py): with --chunk-rounds, a shard reads a push at
most `--push-lead-mib` ahead of the slowest push of its round still streaming.

Unit tests drive the rule and a chunked shard object directly (a paced push in a thread
while another push catches up, ends or is dropped); an integration test trains a real
job whose shards pace (a lead far below one slot, so every slot waits) and checks it
gives the bits of an unpaced one, and that the pacing really held pushes back.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from psar.ps.server.config import ServerConfig
from psar.ps.server.intake import pacing
from psar.ps.server.shard import ShardState
from tests.procs import run_ps_workers, shard_stats, shards
from tests.ps_fixtures import grad_for, init_values, make_job
from tests.test_chunk_rounds import begin, full_push, stream

# ---- the rule -------------------------------------------------------------------------


@dataclass
class _H:
    worker: int


@dataclass
class _T:
    header: _H
    bytes_in: int = 0
    accepted: bool = False
    lock: object = True


def tickets(*sizes: int) -> dict[int, _T]:
    return {w: _T(_H(w), n) for w, n in enumerate(sizes)}


def test_a_push_is_ahead_only_by_the_lead_over_the_slowest_streaming_one() -> None:
    t = tickets(300, 100, 250)
    ahead = pacing.ahead
    assert ahead(t, t[0], 200)  # 300 - 100 >= 200
    assert not ahead(t, t[0], 201)
    assert not ahead(t, t[1], 1)  # the slowest is never held back
    assert not ahead(t, t[0], 0)  # lead 0: no pacing
    t[1].accepted = True  # a finished push holds nobody back: 300 - 250
    assert not ahead(t, t[0], 51) and ahead(t, t[0], 50)
    t[2].lock = None  # released (dropped) too: nobody left to wait for
    assert not ahead(t, t[0], 1)


def test_workers_that_have_not_begun_and_stale_tickets_do_not_count() -> None:
    t = tickets(300)
    assert not pacing.ahead(t, t[0], 1)  # alone in the round so far
    stale = _T(_H(0), 10_000)  # a push no longer the round's (replaced)
    t[1] = _T(_H(1), 0)
    assert not pacing.ahead(t, stale, 1)


def test_server_flag_is_checked_and_maps_to_the_shard() -> None:
    assert ServerConfig(push_lead_mib=0).push_lead_mib == 0
    with pytest.raises(ValueError, match="--push-lead-mib"):
        ServerConfig(push_lead_mib=-1)


# ---- a chunked shard ------------------------------------------------------------------


def paced_state(lead: int) -> tuple[ShardState, object]:
    job = make_job("sync", num_workers=2)
    st = ShardState(chunk_rounds=True, push_lead_bytes=lead)
    st.init(job, init_values(job))
    return st, job


def pace_in_thread(st: ShardState, ticket: object) -> tuple[threading.Thread, list[float]]:
    waited: list[float] = []
    th = threading.Thread(target=lambda: waited.append(st.intake.pace_push(ticket, 0)), daemon=True)
    th.start()
    return th, waited


def test_a_push_ahead_waits_until_the_slowest_catches_up() -> None:
    st, job = paced_state(lead=16)
    g0, g1 = grad_for(job, 0, 1), grad_for(job, 1, 1)
    keys = list(reversed(g0))
    t0, t1 = begin(st, 0), begin(st, 1)
    try:
        stream(st, t0, g0, keys[:1])  # worker 0 is one slot (>= 16 bytes) ahead
        assert st.intake.pace_push(t0, 5) == 0.0  # mid-slot pieces are never held
        th, waited = pace_in_thread(st, t0)
        th.join(0.3)
        assert th.is_alive(), "a push one slot ahead of the lead was not held back"
        stream(st, t1, g1, keys[:1])  # the slowest catches up: the wait ends
        th.join(5)
        assert not th.is_alive() and waited[0] > 0
        assert t0.paced_s == waited[0] and st.stats()["push_paced_s"] == waited[0]
        stream(st, t0, g0, keys[1:])
        stream(st, t1, g1, keys[1:])
        for t in (t0, t1):
            st.intake.add_verdict(t, False)
            st.intake.finish_push(t)
    finally:
        t0.release()
        t1.release()
    # The same round as without pacing.
    plain = ShardState(chunk_rounds=True)
    plain.init(job, init_values(job))
    full_push(plain, 0, g0)
    full_push(plain, 1, g1)
    assert st.state_digest() == plain.state_digest()


def test_a_dropped_slowest_push_releases_the_waiter() -> None:
    st, job = paced_state(lead=16)
    t0, t1 = begin(st, 0), begin(st, 1)
    try:
        stream(st, t0, grad_for(job, 0, 1), [job.slots[-1].key])
        th, _ = pace_in_thread(st, t0)
        th.join(0.3)
        assert th.is_alive()
        t1.release()  # worker 1's push broke off: it holds nobody back any more
        th.join(5)
        assert not th.is_alive()
    finally:
        t0.release()


def test_a_push_waits_at_most_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pacing, "BUDGET_S", 0.2)
    st, job = paced_state(lead=16)
    t0, t1 = begin(st, 0), begin(st, 1)
    try:
        stream(st, t0, grad_for(job, 0, 1), [job.slots[-1].key])
        assert st.intake.pace_push(t0, 0) > 0  # worker 1 never moves: the budget ends it
        assert st.intake.pace_push(t0, 0) == 0.0  # spent: never held again
    finally:
        t0.release()
        t1.release()


def test_no_pacing_without_a_lead_or_per_chunk_rounds() -> None:
    job = make_job("sync", num_workers=2)
    for st in (ShardState(chunk_rounds=True), ShardState(push_lead_bytes=16)):
        st.init(job, init_values(job))
        t0, t1 = begin(st, 0), begin(st, 1)
        try:
            stream(st, t0, grad_for(job, 0, 1), [job.slots[-1].key])
            assert st.intake.pace_push(t0, 0) == 0.0
        finally:
            t0.release()
            t1.release()


# ---- real processes -------------------------------------------------------------------

COMMON = ["--workload", "mlp", "--steps", "6", "--batch-size", "16", "--seed", "3",
          "--lr", "0.05", "--momentum", "0.9", "--precision", "fp32", "--overlap-trial", "0",
          "--chunk-mib", "0.0625"]  # fmt: skip


@pytest.mark.slow
def test_a_paced_job_trains_the_bits_of_an_unpaced_one(tmp_path) -> None:  # noqa: ANN001
    """2 workers, 2 shards over the data plane with early pulls; the paced shards hold a
    push back as soon as it is 64 bytes ahead, i.e. at nearly every slot."""
    runs = {"unpaced": ["--push-lead-mib", "0"], "paced": ["--push-lead-mib", "0.00006"]}
    reports, stats = {}, {}

    def run(name: str, d: Path) -> None:
        d.mkdir()
        with shards(2, "--chunk-rounds", *runs[name]) as addrs:
            reports[name] = run_ps_workers(
                addrs, 2, d, [*COMMON, "--early-pull", "--save", str(d / "w.pt")]
            )
            stats[name] = shard_stats(addrs)

    run("unpaced", tmp_path / "unpaced")
    assert sum(s["push_paced_s"] for s in stats["unpaced"]) == 0
    # Pacing holds a push only while the other worker's is behind it; on a loaded machine
    # the two workers' pushes may not overlap in one short job, so up to three tries.
    for attempt in range(3):
        run("paced", tmp_path / f"paced{attempt}")
        got = torch.load(tmp_path / f"paced{attempt}" / "w.pt", weights_only=True)
        ref = torch.load(tmp_path / "unpaced" / "w.pt", weights_only=True)
        assert all(torch.equal(ref[k], got[k]) for k in ref)  # held or not: the same bits
        if sum(s["push_paced_s"] for s in stats["paced"]) > 0:
            break
    assert sum(s["push_paced_s"] for s in stats["paced"]) > 0, "pacing never held a push"
    for r in range(2):
        assert reports["paced"][r]["losses"] == reports["unpaced"][r]["losses"]
