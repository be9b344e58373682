"""Tests for ``psar plan``: formulas, unit parsing, winner logic, JSON and CLI."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from psar.worker.plan import build_parser, main
from psar.worker.plan_model import PlanInputs, plan
from psar.worker.plan_types import DTYPE_BYTES, OPTIMIZER_STATES
from psar.worker.plan_units import (
    human_bytes,
    human_seconds,
    parse_bandwidth,
    parse_latency,
    parse_params,
    parse_size,
)

GB = 1e9


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


# --- the textbook example -------------------------------------------------------------


def test_textbook_500m_fp32_on_32_workers() -> None:
    """500M fp32 params: M = 2 GB; the ring sends 2*31/32*2 GB = 3.875 GB per worker."""
    r = plan(PlanInputs(params=500_000_000, workers=32, wire_dtype="fp32"))
    assert r.inputs.wire_bytes == 2 * GB
    ar = r.allreduce
    assert ar.bytes_sent_per_worker_per_step == ar.bytes_received_per_worker_per_step
    assert ar.bytes_sent_per_worker_per_step == pytest.approx(3.875 * GB, rel=1e-12)
    # "About twice M through each ring link": each worker's link to its right neighbour.
    assert ar.bytes_sent_per_worker_per_step / r.inputs.wire_bytes == pytest.approx(1.9375)


def test_textbook_example_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--params", "500M", "--workers", "32"]) == 0
    out = capsys.readouterr().out
    assert "M = 2 GB" in out and "3.875 GB" in out
    assert "10 GB" in out  # DDP memory: 4 + 4 + 2*4 + 4 (buckets) bytes per parameter


# --- formulas ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 3, 8, 32, 1000])
@pytest.mark.parametrize("s", [1, 4, 7])
@pytest.mark.parametrize("dtype", sorted(DTYPE_BYTES))
def test_traffic_formulas(n: int, s: int, dtype: str) -> None:
    p, beta, alpha = 125_000_000, 12.5e9, 5e-6
    r = plan(
        PlanInputs(
            p, n, s, bandwidth_bytes_per_second=beta, latency_seconds=alpha, wire_dtype=dtype
        )
    )
    m = p * DTYPE_BYTES[dtype]
    ar, ps = r.allreduce, r.ps
    assert ar.bytes_sent_per_worker_per_step == pytest.approx(2 * (n - 1) / n * m)
    assert ar.bytes_received_per_worker_per_step == pytest.approx(2 * (n - 1) / n * m)
    assert ar.comm_seconds_per_step == pytest.approx(2 * (n - 1) * (alpha + m / n / beta))
    assert ps.bytes_sent_per_worker_per_step == m
    assert ps.bytes_received_per_worker_per_step == m
    assert ps.bytes_received_per_shard_per_step == pytest.approx(n * m / s)
    assert ps.bytes_sent_per_shard_per_step == pytest.approx(n * m / s)
    worker = 2 * alpha + 2 * m / beta
    shard = 2 * alpha + 2 * n * m / s / beta
    assert ps.comm_seconds_per_step == pytest.approx(max(worker, shard))
    assert ps.bottleneck == ("shard_nic" if n > s else "worker_nic")


def test_one_worker_allreduce_moves_nothing() -> None:
    r = plan(PlanInputs(params=10**6, workers=1, compute_seconds=0.05))
    assert r.allreduce.bytes_sent_per_worker_per_step == 0
    assert r.allreduce.comm_seconds_per_step == 0
    assert r.allreduce.bottleneck == "none"
    assert r.allreduce.step_seconds_overlap == pytest.approx(0.05)
    assert r.ps.comm_seconds_per_step > 0  # the PS round trip still happens
    assert r.winner == "allreduce"


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZER_STATES))
@pytest.mark.parametrize("worker_weights", sorted(DTYPE_BYTES))
@pytest.mark.parametrize("s", [1, 3, 4])
def test_memory(optimizer: str, worker_weights: str, s: int) -> None:
    p, n = 1_000_000, 8
    k = {"sgd": 0, "sgd-momentum": 1, "adamw": 2}[optimizer]
    r = plan(PlanInputs(p, n, s, optimizer=optimizer, worker_weights=worker_weights))
    # fp32 weights, gradients, k states and DDP's flat fp32 buckets
    assert r.allreduce.memory_per_worker.total == (4 + 4 + 4 * k + 4) * p
    assert r.allreduce.memory_per_worker.buffers == 4 * p
    w = DTYPE_BYTES[worker_weights]
    # working weights + gradients + a send buffer per slot in the wire dtype (fp32 here)
    assert r.ps.memory_per_worker.total == (2 * w + 4) * p
    shard = r.ps.memory_per_shard
    assert shard is not None
    held = -(-p // s)  # the largest shard
    assert shard.fp32_masters == 4 * held and shard.optimizer_state == 4 * k * held
    assert shard.gradients == (n + 1) * 4 * held  # fp32 wire: N staged pushes + their sum
    assert shard.buffers == (0 if worker_weights == "fp32" else w * held)  # pull snapshot


def test_shard_memory_of_an_exact_fp16_round_and_of_chunk_rounds() -> None:
    p = 1_000_000
    whole = plan(PlanInputs(p, 8, 2, wire_dtype="fp16", worker_weights="fp16",
                            exact_fp16_sum=True)).ps  # fmt: skip
    assert whole.memory_per_shard is not None
    # int64 exact sum + its fp32 mean, and the fp16 bytes of each push in flight (8)
    assert whole.memory_per_shard.gradients == (12 + 2 * 8) * p // 2
    assert whole.memory_per_shard.buffers == 2 * p // 2  # fp16 snapshot for pulls
    assert whole.memory_per_shard.total == (4 + 8 + 12 + 2 * 8 + 2) * p // 2
    chunks = plan(PlanInputs(p, 8, 2, wire_dtype="fp16", worker_weights="fp16",
                             early_pull=True, exact_fp16_sum=True)).ps  # fmt: skip
    rank_order = plan(PlanInputs(p, 8, 2, wire_dtype="fp16", worker_weights="fp16",
                                 exact_fp16_sum=False)).ps  # fmt: skip
    # --no-exact-fp16-sum: 8 pushes staged in fp32 + their sum
    assert rank_order.memory_per_shard is not None
    assert rank_order.memory_per_shard.gradients == (8 + 1) * 4 * p // 2
    assert chunks.memory_per_shard is not None
    # + undo copies of the master and its two moments, and a mean buffer per slot
    assert chunks.memory_per_shard.buffers == (2 + 4 + 8 + 4) * p // 2
    assert whole.memory_per_worker.total == (2 + 2 + 2) * p  # fp16 weights, grads, send


def test_step_times_with_compute() -> None:
    r = plan(PlanInputs(params=10**8, workers=16, servers=2, compute_seconds=0.1))
    for arch in (r.allreduce, r.ps):
        comm, tail = arch.comm_seconds_per_step, arch.tail_seconds
        assert arch.step_seconds_no_overlap == pytest.approx(0.1 + comm)
        assert arch.step_seconds_overlap == pytest.approx(max(0.1, comm) + min(tail, 0.1))


@given(
    p=st.integers(1, 10**11),
    n=st.integers(1, 4096),
    s=st.integers(1, 256),
    alpha=st.floats(0, 1),
    beta=st.floats(1e3, 1e13),
    compute=st.floats(0, 10),
    bucket=st.integers(1, 2**30),
)
def test_model_invariants(
    p: int, n: int, s: int, alpha: float, beta: float, compute: float, bucket: int
) -> None:
    r = plan(PlanInputs(p, n, s, beta, alpha, compute_seconds=compute, bucket_bytes=bucket))
    # Every "seconds" here is the cost model's arithmetic on the inputs above (no clock is
    # read, nothing runs): invariants of the formulas, not a timing goal.
    for arch in (r.allreduce, r.ps):
        no, yes = arch.step_seconds_no_overlap, arch.step_seconds_overlap
        assert no is not None and yes is not None
        assert max(compute, arch.comm_seconds_per_step) <= yes <= no * (1 + 1e-12)
        assert arch.tail_seconds <= arch.comm_seconds_per_step * (1 + 1e-12)
    # Push then pull (the default): the ring always uses less bandwidth time than PS, so PS
    # can only win on latency (pipelined early pulls: the tests at the end of this file).
    assert r.allreduce.worker_comm.bandwidth_seconds < r.ps.comm_seconds_per_step or n == 1
    assert r.winner in ("allreduce", "ps")


# --- winner logic -------------------------------------------------------------------------


def test_many_workers_one_shard_allreduce_wins() -> None:
    r = plan(PlanInputs(params=10**9, workers=1024, servers=1))
    assert r.winner == "allreduce" and r.ps.bottleneck == "shard_nic"
    assert "N*M/S" in r.reason and "1024 workers per shard" in r.reason


# 1M fp16 params = 2 MB on 4 workers, 8 shards, 10 Gbit/s links with 1 ms latency.
LATENCY_BOUND = dict(params=10**6, workers=4, servers=8, wire_dtype="fp16")
LATENCY_BOUND.update(bandwidth_bytes_per_second=1.25e9, latency_seconds=1e-3)


def test_few_workers_many_shards_high_latency_ps_wins() -> None:
    # Ring: 6 * (1 ms + 0.5 MB / 1.25 GB/s) = 8.4 ms.
    # PS: 2 * 1 ms + 2 * 2 MB / 1.25 GB/s = 5.2 ms (workers, not shards, bound).
    r = plan(PlanInputs(**LATENCY_BOUND))  # type: ignore[arg-type]
    assert r.allreduce.comm_seconds_per_step == pytest.approx(8.4e-3)
    assert r.ps.comm_seconds_per_step == pytest.approx(5.2e-3)
    assert r.winner == "ps" and "latency" in r.reason


def test_same_setup_low_latency_allreduce_wins() -> None:
    r = plan(PlanInputs(params=10**6, workers=4, servers=8, latency_seconds=1e-6))
    assert r.winner == "allreduce"
    assert "one after the other" in r.reason


@given(n=st.integers(3, 64), extra=st.integers(0, 8), p=st.integers(1, 10**9), a=st.floats(0, 0.1))
def test_ps_wins_exactly_past_the_documented_latency_threshold(
    n: int, extra: int, p: int, a: float
) -> None:
    # docs/cost-model.md: with S >= N, PS wins iff (N-2)*alpha > M/(N*beta).
    r = plan(PlanInputs(p, n, n + extra, bandwidth_bytes_per_second=1e9, latency_seconds=a))
    lhs, rhs = (n - 2) * a, 4 * p / (n * 1e9)
    if not math.isclose(lhs, rhs, rel_tol=1e-9, abs_tol=1e-15):
        assert r.winner == ("ps" if lhs > rhs else "allreduce")


def test_winner_uses_overlapped_step_when_compute_given() -> None:
    # Both comm times hide under 10 s of compute; the ring's smaller tail decides.
    r = plan(PlanInputs(params=10**7, workers=8, servers=8, compute_seconds=10.0))
    assert r.winner == "allreduce"
    assert r.allreduce.step_seconds_overlap < r.ps.step_seconds_overlap  # type: ignore[operator]
    assert "hide their communication" in r.reason


def test_winner_uses_step_time_and_ps_can_win_it() -> None:
    r = plan(PlanInputs(**LATENCY_BOUND, compute_seconds=0.001))  # type: ignore[arg-type]
    assert r.winner == "ps"
    assert r.ps.step_seconds_overlap < r.allreduce.step_seconds_overlap  # type: ignore[operator]


def test_step_winner_can_differ_from_comm_winner() -> None:
    # N=4, S=8, 1 ms latency, M/beta = 10 ms: ring comm 6 + 15 = 21 ms beats PS's
    # 2 + 20 = 22 ms, but with 20 ms of compute and tiny buckets the exposed tails are
    # the latency rounds (6 ms vs 2 ms), so PS's step is shorter: 24 ms vs 27 ms.
    inp = PlanInputs(3_125_000, 4, 8, 1.25e9, 1e-3, compute_seconds=0.02, bucket_bytes=1)
    r = plan(inp)
    assert r.allreduce.comm_seconds_per_step == pytest.approx(0.021)
    assert r.ps.comm_seconds_per_step == pytest.approx(0.022)
    assert r.allreduce.step_seconds_overlap == pytest.approx(0.027, rel=1e-5)
    assert r.ps.step_seconds_overlap == pytest.approx(0.024, rel=1e-5)
    assert r.winner == "ps" and "despite" in r.reason


# --- unit parsing -------------------------------------------------------------------------


# fmt: off
PARAMS_OK = {
    "500M": 500_000_000, "1.5B": 1_500_000_000, "7e9": 7_000_000_000, "125k": 125_000,
    "125K": 125_000, "350000": 350_000, "2G": 2 * 10**9, "1T": 10**12, " 3M ": 3 * 10**6,
    "0.5k": 500,
}
BANDWIDTH_OK = {  # bytes per second
    "100Gbit/s": 12.5e9, "25GB/s": 25e9, "10Gbps": 1.25e9, "1.25GiB/s": 1.25 * 2**30,
    "800Mbit/s": 100e6, "10Gb/s": 1.25e9, "10GBps": 10e9, "1Gibit/s": 2**30 / 8,
    "100MiB/s": 100 * 2**20, "8bit/s": 1.0, "1kB/s": 1e3, "40 Gbit/s": 5e9,
}
LATENCY_OK = {
    "5us": 5e-6, "0.5ms": 5e-4, "2s": 2.0, "100ns": 1e-7, "5\u00b5s": 5e-6, "0": 0.0,
    "0us": 0.0,
}
# fmt: on


@pytest.mark.parametrize(("text", "expected"), PARAMS_OK.items())
def test_parse_params(text: str, expected: int) -> None:
    assert parse_params(text) == expected


@pytest.mark.parametrize("text", ["bad", "", "1.5", "0", "-5M", "5MB", "1e-3", "inf", "nan", "5 m"])
def test_parse_params_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="500M"):
        parse_params(text)


@pytest.mark.parametrize(("text", "bytes_per_s"), BANDWIDTH_OK.items())
def test_parse_bandwidth(text: str, bytes_per_s: float) -> None:
    assert parse_bandwidth(text) == pytest.approx(bytes_per_s, rel=1e-15)


@pytest.mark.parametrize(
    "text", ["10 parsecs", "100G", "100", "10gbps", "0Gbit/s", "5mB/s", "Gbit/s"]
)
def test_parse_bandwidth_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="100Gbit/s"):
        parse_bandwidth(text)


@pytest.mark.parametrize(("text", "seconds"), LATENCY_OK.items())
def test_parse_latency(text: str, seconds: float) -> None:
    assert parse_latency(text) == pytest.approx(seconds, rel=1e-15)


@pytest.mark.parametrize("text", ["5", "5 parsecs", "-1ms", "ms", "5min", "1h"])
def test_parse_latency_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="5us"):
        parse_latency(text)


@pytest.mark.parametrize(("text", "n"), [("25MiB", 25 * 2**20), ("4MB", 4_000_000), ("1B", 1)])
def test_parse_size(text: str, n: int) -> None:
    assert parse_size(text) == n


def test_human_units() -> None:
    assert human_bytes(3.875e9) == "3.875 GB"
    assert human_bytes(512) == "512 B"
    assert human_seconds(0.1553) == "155.3 ms"
    assert human_seconds(5e-6) == "5 us"
    assert human_seconds(0) == "0 s"


# --- JSON ---------------------------------------------------------------------------------

EXAMPLE = [
    "--params", "500M", "--workers", "32", "--servers", "4", "--bandwidth", "100Gbit/s",
    "--latency", "5us", "--wire-dtype", "fp16", "--optimizer", "adamw",
]  # fmt: skip


def test_json_keys_and_values(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, *EXAMPLE, "--compute-ms", "120")
    assert set(d) == {
        "allreduce", "ps", "winner", "reason", "byteps_bound_seconds", "margin", "inputs",
        "launch_command", "train_flags",
    }  # fmt: skip
    common = {
        "bytes_sent_per_worker_per_step",
        "bytes_received_per_worker_per_step",
        "comm_seconds_per_step",
        "memory_per_worker_bytes",
        "step_seconds_no_overlap",
        "step_seconds_overlap",
    }
    assert common <= set(d["allreduce"])
    assert common | {
        "bytes_received_per_shard_per_step",
        "bytes_sent_per_shard_per_step",
        "memory_per_shard_bytes",
    } <= set(d["ps"])
    assert d["inputs"]["params"] == 500_000_000
    assert d["inputs"]["bandwidth_bytes_per_second"] == 12.5e9
    assert d["inputs"]["compute_seconds"] == pytest.approx(0.12)
    m = 1e9  # fp16
    assert d["allreduce"]["bytes_sent_per_worker_per_step"] == pytest.approx(2 * 31 / 32 * m)
    assert d["ps"]["bytes_received_per_shard_per_step"] == pytest.approx(32 * m / 4)
    # AdamW, fp16 wire: masters 4 + moments 8 + the exact sum 8 and mean 4 + 2 per
    # worker's push in flight (+ early pulls' undo copies 16) per parameter held;
    # workers 4 + 4 + 2 (fp32 weights)
    shard = 24 + 2 * 32 + (16 if d["inputs"]["early_pull"] else 0)
    assert d["ps"]["memory_per_shard_bytes"] == shard * 500_000_000 // 4
    # psar server --no-exact-fp16-sum: 32 pushes staged in fp32 and their sum, 4 x 33
    off = run_json(capsys, *EXAMPLE, "--compute-ms", "120", "--no-exact-fp16-sum")
    assert off["ps"]["memory_per_shard_bytes"] == (shard - 12 - 2 * 32 + 4 * 33) * 500_000_000 // 4
    assert d["ps"]["memory_per_worker_bytes"] == 10 * 500_000_000
    assert d["allreduce"]["memory_per_worker_bytes"] == 20 * 500_000_000
    assert d["winner"] == "allreduce"
    best = min(("allreduce", "ps"), key=lambda a: d[a]["step_seconds_overlap"])
    assert d["winner"] == best


def test_json_without_compute_has_no_step_keys(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, *EXAMPLE)
    assert "step_seconds_overlap" not in d["allreduce"]
    assert "memory_per_shard_bytes" not in d["allreduce"]
    assert d["inputs"]["compute_seconds"] is None
    best = min(("allreduce", "ps"), key=lambda a: d[a]["comm_seconds_per_step"])
    assert d["winner"] == best


def test_table_matches_json(capsys: pytest.CaptureFixture[str]) -> None:
    d = run_json(capsys, *EXAMPLE, "--compute-ms", "120")
    assert main([*EXAMPLE, "--compute-ms", "120"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[1].strip(): line for line in out.splitlines() if line.startswith("  ")}
    for label, key, fmt in [
        ("sent per worker per step", "bytes_sent_per_worker_per_step", human_bytes),
        ("comm time per step", "comm_seconds_per_step", human_seconds),
        ("memory per worker", "memory_per_worker_bytes", human_bytes),
        ("step time, with overlap", "step_seconds_overlap", human_seconds),
    ]:
        cells = rows[label].split()[-4:]
        assert " ".join(cells) == f"{fmt(d['allreduce'][key])} {fmt(d['ps'][key])}"
    assert human_bytes(d["ps"]["memory_per_shard_bytes"]) in rows["memory per shard"]
    assert out.rstrip().splitlines()[-1] == d["reason"]
    assert d["reason"].startswith(f"{d['winner']} wins")


# --- CLI ----------------------------------------------------------------------------------


BASE = ["--params", "1M", "--workers", "4"]


# fmt: off
@pytest.mark.parametrize(
    ("argv", "flag", "hint"),
    [
        (["--params", "bad", "--workers", "4"], "--params", "500M"),
        (["--params", "1M", "--workers", "0"], "--workers", ">= 1"),
        (["--params", "1M", "--workers", "x"], "--workers", ">= 1"),
        ([*BASE, "--servers", "0"], "--servers", ">= 1"),
        ([*BASE, "--bandwidth", "10 parsecs"], "--bandwidth", "10Gbps"),
        ([*BASE, "--latency", "soon"], "--latency", "0.5ms"),
        ([*BASE, "--compute-ms", "-3"], "--compute-ms", "120"),
        ([*BASE, "--wire-dtype", "fp64"], "--wire-dtype", "fp16"),
        ([*BASE, "--optimizer", "lion"], "--optimizer", "sgd-momentum"),
        ([*BASE, "--bucket", "25"], "--bucket", "25MiB"),
        (["--workers", "4"], "--params", "required"),
    ],
)
# fmt: on
def test_cli_errors_exit_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], flag: str, hint: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and hint in err


def test_bandwidth_error_message_reads_well(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--params", "1M", "--workers", "4", "--bandwidth", "10 parsecs"])
    err = capsys.readouterr().err
    assert "--bandwidth: cannot read '10 parsecs'; use forms like 100Gbit/s, 25GB/s, 10Gbps" in err


def test_build_parser_for_dry_run() -> None:
    p = build_parser()
    assert p.prog == "psar plan"
    args = p.parse_args([*EXAMPLE, "--compute-ms", "120", "--json"])
    assert args.params == 500_000_000 and args.workers == 32 and args.servers == 4
    assert args.bandwidth == 12.5e9 and args.latency == pytest.approx(5e-6)
    assert args.compute_ms == pytest.approx(0.12) and args.json is True
    defaults = p.parse_args(["--params", "1M", "--workers", "2"])
    assert defaults.servers == 1 and defaults.wire_dtype == "fp32"
    assert defaults.bucket == 25 * 2**20 and defaults.compute_ms is None
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0


def test_table_is_aligned(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*EXAMPLE, "--compute-ms", "120"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if "allreduce (ring)" in line)
    body = lines[start : lines.index("", start)]
    assert len({len(line) for line in body}) == 1  # right-aligned columns end together


# --- shards on hosts of their own (--shard-hosts) and the BytePS bound (issue #19) -------


def _ps(n: int, s: int, k: int | None, m_params: int = 1_000_000) -> tuple:
    r = plan(
        PlanInputs(
            m_params, n, s, bandwidth_bytes_per_second=1e9, latency_seconds=0.0, shard_hosts=k
        )
    )
    return r, 4 * m_params  # fp32: M bytes


@pytest.mark.parametrize(("n", "k"), [(2, 0), (4, 0), (4, 2), (4, 4), (8, 0), (8, 4), (8, 8)])
def test_byteps_bound_formula(n: int, k: int) -> None:
    r, m = _ps(n, max(k, 1) if k else n, k)
    assert r.byteps_bound_seconds == pytest.approx(2 * n * (n - 1) * m / ((n * n + k * n - 2 * k) * 1e9))


def test_byteps_bound_ends_ring_and_m_over_b() -> None:
    """K = 0 gives the ring's bandwidth term, K = N gives M/B: the 2(N-1)/N speed-up."""
    for n in (2, 4, 8):
        r0, m = _ps(n, n, 0)
        assert r0.byteps_bound_seconds == pytest.approx(r0.allreduce.worker_comm.bandwidth_seconds)
        rn, _ = _ps(n, n, n)
        assert rn.byteps_bound_seconds == pytest.approx(m / 1e9)
        assert r0.byteps_bound_seconds / rn.byteps_bound_seconds == pytest.approx(2 * (n - 1) / n)


def test_default_shard_hosts_is_one_host_per_shard() -> None:
    for n, s in ((4, 1), (4, 4), (8, 2)):
        a, _ = _ps(n, s, None)
        b, _ = _ps(n, s, s)
        assert a.ps.comm_seconds_per_step == b.ps.comm_seconds_per_step
        assert a.inputs.hosts_of_shards == s


@pytest.mark.parametrize(("n", "s", "k"), [(4, 4, 2), (4, 8, 2), (8, 8, 4), (8, 3, 2)])
def test_shards_sharing_hosts_load_the_busiest_host(n: int, s: int, k: int) -> None:
    """K shard hosts: the busiest holds ceil(S/K) shards and takes N*M*ceil(S/K)/S each way."""
    r, m = _ps(n, s, k)
    busiest = -(-s // k)
    shard = 2 * n * m * busiest / s / 1e9
    assert r.ps.comm_seconds_per_step == pytest.approx(max(2 * m / 1e9, shard))


@pytest.mark.parametrize(("n", "s"), [(2, 2), (4, 4), (8, 8), (4, 2), (4, 8), (8, 1)])
def test_shards_on_worker_hosts(n: int, s: int) -> None:
    """K = 0: in the push a host sends its gradient's off-host share and takes the other
    workers' pieces for its shards; the pull mirrors it. One shard per host ties the ring."""
    r, m = _ps(n, s, 0)
    per_phase = []
    for c in {s // n, -(-s // n)}:
        per_phase.append(max(m * (s - c) / s, (n - 1) * m * c / s))
    assert r.ps.comm_seconds_per_step == pytest.approx(2 * max(per_phase) / 1e9)
    assert r.ps.bottleneck == "worker_nic"
    if s == n:
        assert r.ps.comm_seconds_per_step == pytest.approx(r.allreduce.comm_seconds_per_step)


def test_shards_on_worker_hosts_one_worker_moves_nothing() -> None:
    r, _ = _ps(1, 2, 0)
    assert r.ps.comm_seconds_per_step == 0 and r.byteps_bound_seconds == 0


def test_push_then_pull_ps_on_own_hosts_loses_to_the_ring_in_bandwidth() -> None:
    """psar's sync PS pushes, then pulls: at K = N it needs 2M/B, above the ring's
    2(N-1)/N*M/B, though BytePS's pipelined optimum is M/B (see docs/cost-model.md)."""
    r, m = _ps(4, 4, 4)
    assert r.ps.comm_seconds_per_step == pytest.approx(2 * m / 1e9)
    assert r.allreduce.comm_seconds_per_step == pytest.approx(1.5 * m / 1e9)
    assert r.winner == "allreduce"


def test_shard_hosts_cli_json_and_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--params", "1M", "--workers", "4", "--servers", "4", "--bandwidth", "1GB/s"]
    d = run_json(capsys, *argv, "--shard-hosts", "2")
    assert d["winner"] in ("allreduce", "ps")  # the contract key stays
    assert d["inputs"]["shard_hosts"] == 2 and d["inputs"]["hosts_of_shards"] == 2
    assert d["byteps_bound_seconds"] == pytest.approx(2 * 4 * 3 * 4e6 / ((16 + 8 - 4) * 1e9))
    assert d["ps"]["shard_comm_seconds_per_step"] == pytest.approx(2 * 5e-6 + 2 * 8e6 / 1e9)
    assert main([*argv, "--shard-hosts", "0"]) == 0
    out = capsys.readouterr().out
    assert "4 PS shards on the worker hosts" in out
    assert "BytePS bound, N = 4, K = 0" in out
    assert out.rstrip().splitlines()[-1].startswith(("allreduce wins", "ps wins"))


@pytest.mark.parametrize("value", ["-1", "x", "1.5"])
def test_shard_hosts_cli_rejects(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--params", "1M", "--workers", "4", "--shard-hosts", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--shard-hosts" in err and ">= 0" in err


def test_more_shard_hosts_than_shards_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="between 0 .* and the number of shards"):
        PlanInputs(1000, 4, 2, shard_hosts=3)
    with pytest.raises(SystemExit) as e:
        main(["--params", "1M", "--workers", "4", "--servers", "2", "--shard-hosts", "3"])
    assert e.value.code == 2
    assert "number of shards (2)" in capsys.readouterr().err


def test_near_tie_is_called_one() -> None:
    """K = 0 with one shard per worker host ties the ring on bandwidth; PS is ahead by
    2(N-2) latencies only, so the verdict says to treat it as a tie (winner key unchanged)."""
    r = plan(PlanInputs(1_863_690, 4, 4, bandwidth_bytes_per_second=1.25e8,
                        latency_seconds=13e-6, compute_seconds=0.03, shard_hosts=0))  # fmt: skip
    d = r.to_dict()
    assert d["winner"] == "ps" and 0 < d["margin"] < 0.001
    assert "treat it as a tie" in r.reason
    far = plan(PlanInputs(1_863_690, 4, 1, bandwidth_bytes_per_second=1.25e8))
    assert far.to_dict()["margin"] > 1 and "treat it as a tie" not in far.reason


# --- early pulls: push and pull pipelined chunk by chunk (psar plan --early-pull) --------


def _early(n: int, s: int, k: int, chunk: int = 1 << 17, m_params: int = 1_000_000) -> tuple:
    inp = PlanInputs(m_params, n, s, bandwidth_bytes_per_second=1e9, latency_seconds=0.0,
                     shard_hosts=k, early_pull=True, chunk_bytes=chunk)  # fmt: skip
    return plan(inp), 4 * m_params


@pytest.mark.parametrize("n", [2, 4, 8])
def test_early_pulls_with_a_host_per_worker_reach_the_byteps_bound_plus_a_chunk_per_shard(
    n: int,
) -> None:
    # Every shard's last chunk closes when the push ends: each worker then receives n of
    # them (one per shard), and each shard sends its last one to n workers.
    r, m = _early(n, n, n)
    tail = n * (1 << 17)
    assert r.ps.worker_comm.bandwidth_seconds == pytest.approx((m + tail) / 1e9)
    assert r.ps.shard_comm.bandwidth_seconds == pytest.approx((m + tail) / 1e9)
    assert r.ps.comm_seconds_per_step == pytest.approx(r.byteps_bound_seconds + tail / 1e9)
    if n > 2:  # the ring moves 2(N-1)/N*M each way: more than M from N = 3 on
        assert r.winner == "ps" and "early pulls" in r.reason
        plain, _ = _ps(n, n, n)
        assert plain.winner == "allreduce"


@pytest.mark.parametrize(("n", "s", "k"), [(4, 4, 2), (8, 8, 4), (4, 8, 2)])
def test_early_pulls_on_shared_shard_hosts_pay_the_busiest_host_once_each_way(n, s, k) -> None:  # noqa: ANN001
    r, m = _early(n, s, k, chunk=1024)
    per_host = -(-s // k)
    shard = n * m * per_host / s
    shard_tail, worker_tail = n * per_host * 1024, s * 1024
    assert r.ps.shard_comm.bandwidth_seconds == pytest.approx((shard + shard_tail) / 1e9)
    want = max(m + worker_tail, shard + shard_tail) / 1e9
    assert r.ps.comm_seconds_per_step == pytest.approx(want)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_early_pulls_with_shards_on_the_worker_hosts_tie_the_ring_plus_the_last_chunks(
    n: int,
) -> None:
    r, m = _early(n, n, 0, chunk=1024)
    ring = r.allreduce.worker_comm.bandwidth_seconds
    # The last chunk of each of the n - 1 other hosts' shards comes in; this host's shard
    # sends its last chunk to the n - 1 other workers.
    assert r.ps.worker_comm.bandwidth_seconds == pytest.approx(ring + (n - 1) * 1024 / 1e9)
    assert r.winner == "allreduce"


def test_early_pull_flags_reach_the_model_and_bad_chunks_are_refused(capsys) -> None:  # noqa: ANN001
    argv = ["--params", "1M", "--workers", "4", "--servers", "4", "--shard-hosts", "4",
            "--bandwidth", "1Gbit/s", "--json"]  # fmt: skip
    assert main([*argv, "--early-pull", "--chunk-mib", "0.125"]) == 0
    early = json.loads(capsys.readouterr().out)
    assert main([*argv, "--no-early-pull"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert early["winner"] == "ps" and plain["winner"] == "allreduce"
    assert early["ps"]["comm_seconds_per_step"] < plain["ps"]["comm_seconds_per_step"]
    with pytest.raises(SystemExit):
        main([*argv, "--early-pull", "--chunk-mib", "0"])
    assert "--chunk-mib" in capsys.readouterr().err


# --- the CPU that moves the bytes (psar plan --cpu-cores [--cpu-shared]) --------------


def _cpu(n: int, s: int, k: int, shared: bool, cores: float = 2.0, **kw: object) -> tuple:
    inp = PlanInputs(1_000_000, n, s, bandwidth_bytes_per_second=1.25e9, latency_seconds=0.0,
                     shard_hosts=k, early_pull=True, chunk_bytes=1024, cpu_cores=cores,
                     cpu_shared=shared, ps_cpu_bytes_per_second=2e9,
                     allreduce_cpu_bytes_per_second=3e9, **kw)  # fmt: skip
    return plan(inp), 4_000_000


@pytest.mark.parametrize("n", [2, 4, 8])
def test_shared_cores_move_every_processs_bytes(n: int) -> None:
    # One machine's 2 cores carry every worker's push and pull (2M each) and every
    # shard's N*M/S in and out; the ring's workers 2(N-1)/N*M each way each.
    r, m = _cpu(n, n, n, shared=True)
    assert r.ps.cpu_seconds == pytest.approx(4 * n * m / 2e9 / 2)
    assert r.allreduce.cpu_seconds == pytest.approx(4 * (n - 1) * m / 3e9 / 2)
    assert r.ps.bottleneck == "cpu"  # 10 Gbit/s links outpace 2 cores
    assert r.allreduce.bottleneck == ("cpu" if n > 2 else "worker_nic")
    # The model's arithmetic on the inputs above (no clock is read): not a timing goal.
    assert r.ps.comm_seconds_per_step == r.ps.cpu_seconds > r.ps.link_seconds_per_step
    assert r.winner == "allreduce" and "CPU that moves the bytes" in r.reason
    d = r.to_dict()
    assert d["ps"]["cpu_seconds_per_step"] == r.ps.cpu_seconds
    assert d["ps"]["link_seconds_per_step"] == r.ps.link_seconds_per_step


@pytest.mark.parametrize(("n", "s", "k"), [(4, 4, 4), (4, 4, 2), (4, 4, 0), (8, 4, 4)])
def test_cores_of_their_own_carry_the_busiest_hosts_bytes(n: int, s: int, k: int) -> None:
    r, m = _cpu(n, s, k, shared=False, cores=1.0)
    per_host = -(-s // (k or n))
    shards = 2 * n * m * per_host / s
    want = 2 * m + shards if k == 0 else max(2 * m, shards)
    assert r.ps.cpu_seconds == pytest.approx(want / 2e9)
    assert r.allreduce.cpu_seconds == pytest.approx(4 * (n - 1) * m / n / 3e9)


def test_without_cpu_cores_only_the_links_count() -> None:
    r, _ = _early(4, 4, 4)
    assert r.ps.cpu_seconds == r.allreduce.cpu_seconds == 0.0
    assert r.ps.comm_seconds_per_step == r.ps.link_seconds_per_step
    assert r.ps.bottleneck != "cpu"


def test_local_mode_divides_the_cpu_time_by_h() -> None:
    every, m = _cpu(4, 4, 4, shared=True)
    local, _ = _cpu(4, 4, 4, shared=True, sync_every=10)
    assert local.ps.cpu_seconds == pytest.approx(every.ps.cpu_seconds / 10)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_shared_cores_run_every_workers_own_cpu_in_the_compute_phase(n: int) -> None:
    # On one machine the cores that move the bytes also run each worker's forward,
    # backward and optimizer, all workers at once before they communicate: the compute
    # phase lasts at least N*W/C, for either design; the bytes' CPU is what it was.
    base, _ = _cpu(n, n, n, shared=True, compute_seconds=0.03)
    own, _ = _cpu(n, n, n, shared=True, compute_seconds=0.03, worker_cpu_seconds=0.09)
    for arch in ("ps", "allreduce"):
        b, o = getattr(base, arch), getattr(own, arch)
        assert o.cpu_seconds == b.cpu_seconds and b.workers_cpu_seconds == 0
        assert o.workers_cpu_seconds == pytest.approx(n * 0.09 / 2)
        assert o.compute_phase_seconds == pytest.approx(max(0.03, n * 0.09 / 2))
        assert o.step_seconds_no_overlap == pytest.approx(
            o.compute_phase_seconds + o.comm_seconds_per_step
        )
        assert o.to_dict()["workers_cpu_seconds_per_step"] == o.workers_cpu_seconds
    no_compute, _ = _cpu(n, n, n, shared=True, worker_cpu_seconds=0.09)
    assert "workers' own CPU" in no_compute.reason
    assert "workers' own CPU" not in _cpu(n, n, n, shared=True)[0].reason
    assert own.to_dict()["inputs"]["worker_cpu_seconds"] == 0.09
    local, _ = _cpu(n, n, n, shared=True, worker_cpu_seconds=0.09, sync_every=10)
    assert local.ps.workers_cpu_seconds == own.ps.workers_cpu_seconds  # every step computes


def test_worker_cpu_needs_shared_cores_and_a_sane_value() -> None:
    with pytest.raises(ValueError, match="--cpu-shared"):
        _cpu(4, 4, 4, shared=False, worker_cpu_seconds=0.01)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=">= 0"):
            _cpu(4, 4, 4, shared=True, worker_cpu_seconds=bad)


def test_cpu_flags_reach_the_model_and_bad_ones_are_refused(capsys) -> None:  # noqa: ANN001
    argv = ["--params", "20M", "--workers", "4", "--servers", "4", "--bandwidth", "10Gbit/s",
            "--early-pull", "--chunk-mib", "0.5", "--json"]  # fmt: skip
    assert main([*argv, "--cpu-cores", "2", "--cpu-shared", "--ps-cpu-gbps", "2",
                 "--allreduce-cpu-gbps", "3"]) == 0  # fmt: skip
    d = json.loads(capsys.readouterr().out)
    assert d["ps"]["bottleneck"] == "cpu" and d["winner"] == "allreduce"
    assert d["ps"]["cpu_seconds_per_step"] == pytest.approx(4 * 4 * 80e6 / 2e9 / 2)
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["winner"] == "ps"  # links alone: early pulls win
    assert main([*argv[:-1], "--cpu-cores", "2", "--cpu-shared"]) == 0
    assert "CPU time per step" in capsys.readouterr().out
    for bad in (["--cpu-cores", "0"], ["--cpu-cores", "x"], ["--cpu-cores", "1", "--ps-cpu-gbps", "-1"]):
        with pytest.raises(SystemExit):
            main([*argv, *bad])
        assert bad[-2] in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--cpu-shared"])
    assert "cpu_shared needs cpu_cores" in capsys.readouterr().err
    shared = [*argv, "--cpu-cores", "2", "--cpu-shared", "--ps-cpu-gbps", "2",
              "--allreduce-cpu-gbps", "3"]  # fmt: skip
    assert main([*shared, "--worker-cpu-ms", "100", "--compute-ms", "30"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ps"]["cpu_seconds_per_step"] == pytest.approx(4 * 4 * 80e6 / 2e9 / 2)
    assert d["ps"]["workers_cpu_seconds_per_step"] == pytest.approx(4 * 0.1 / 2)
    assert d["allreduce"]["compute_phase_seconds"] == pytest.approx(0.2)
    table = [*argv[:-1], *shared[len(argv) :]]  # the same flags without --json
    assert main([*table, "--worker-cpu-ms", "100", "--compute-ms", "30"]) == 0
    assert "compute phase (workers' CPU, N*W/C)" in capsys.readouterr().out
    for bad, says in ((["--worker-cpu-ms", "-1"], "--worker-cpu-ms"),
                      (["--worker-cpu-ms", "x"], "--worker-cpu-ms")):  # fmt: skip
        with pytest.raises(SystemExit):
            main([*shared, *bad])
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--cpu-cores", "2", "--worker-cpu-ms", "5"])
    assert "needs shared cores (--cpu-shared)" in capsys.readouterr().err


# --- the launch command of the picked regime (issue #34) ------------------------------


def _json(capsys, argv: list[str]) -> dict:  # noqa: ANN001
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "argv, early",
    [
        (["--workers", "4", "--servers", "4", "--shard-hosts", "4"], True),
        (["--workers", "4", "--servers", "4", "--shard-hosts", "0"], True),  # other workers' hosts
        (["--workers", "1", "--servers", "2", "--shard-hosts", "0"], False),  # all on one host
        (["--workers", "4", "--servers", "4", "--sync-every", "8"], False),  # local SGD
    ],
)
def test_plan_models_psar_trains_own_early_pull_default(capsys, argv, early) -> None:  # noqa: ANN001
    d = _json(capsys, ["--params", "20M", "--bandwidth", "1Gbit/s", *argv])
    assert d["inputs"]["early_pull"] is early
    # What the defaults give needs no flag in the printed command.
    assert not {"--early-pull", "--no-early-pull"} & set(d["train_flags"])


def test_the_launch_command_says_only_what_differs_from_the_defaults(capsys) -> None:  # noqa: ANN001
    from psar.worker.cli_parser import build_parser as psar_parser

    base = ["--params", "20M", "--workers", "4", "--servers", "4", "--shard-hosts", "4",
            "--bandwidth", "1Gbit/s", "--compute-ms", "100", "--chunk-mib", "0.5"]  # fmt: skip
    for extra, arch in ((["--wire-dtype", "fp16"], "ps"), (["--no-early-pull"], "allreduce")):
        d = _json(capsys, [*base, *extra])
        assert d["winner"] == arch
        cmd = d["launch_command"][-1]
        assert f"--arch {arch}" in cmd
        # Every flag of the command is one psar train knows, with a value it accepts.
        ns = psar_parser().parse_args(["train", "--arch", arch, *d["train_flags"]])
        assert ns.command == "train"
    ps = _json(capsys, [*base, "--wire-dtype", "fp16"])
    assert "--precision" in ps["train_flags"] and "fp16" in ps["train_flags"]
    assert "--chunk-mib" in ps["train_flags"]  # not psar train's 4 MiB
    assert ps["launch_command"][0].startswith("psar server --bind")
    forced = _json(capsys, [*base, "--no-early-pull", "--optimizer", "sgd"])
    assert forced["winner"] == "allreduce"
    assert main([*base, "--wire-dtype", "fp16"]) == 0
    text = capsys.readouterr().out
    assert "launch (ps):" in text and text.rstrip().splitlines()[-1].startswith("ps wins")
