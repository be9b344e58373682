"""bench/lib/sparse_hosts.py (issue #46 item 4): the emulated hosts' plan, the NIC byte
counts cut to the window every worker trains in, peak memory per process, and the fit
prediction that skips a way before it could push a shared machine into the OOM killer;
then the `--hosts` mode itself on real namespaces at a tiny size (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import sparse
from bench.lib import common as c
from bench.lib import nic
from bench.lib import sparse_hosts as sh

ROOT = Path(__file__).resolve().parents[1]
GB = 10**9


def test_one_host_per_worker_and_per_shard() -> None:
    assert sh.host_names(4, 2) == ["w0", "w1", "w2", "w3", "s0", "s1"]
    with pytest.raises(ValueError, match="shards >= 1"):
        sh.host_names(4, 0)


def test_shards_on_the_workers_hosts_add_no_host() -> None:
    assert sh.host_names(4, 4, "worker-hosts") == ["w0", "w1", "w2", "w3"]
    # Shard i beside worker i % N: more shards than hosts wrap round.
    assert sh.shard_host_names(2, 3, "worker-hosts") == ["w0", "w1", "w0"]
    assert sh.shard_host_names(2, 3) == ["s0", "s1", "s2"]
    with pytest.raises(ValueError, match="--shard-placement: accepted: own-hosts, worker-hosts"):
        sh.host_names(2, 2, "racks")


def test_net_dev_bytes_add_receive_and_transmit() -> None:
    text = (
        "Inter-|   Receive                            |  Transmit\n"
        " face |bytes    packets errs drop fifo frame compressed multicast|bytes packets\n"
        "    lo:     100       1    0    0    0     0          0         0      100    1"
        "    0    0    0     0       0          0\n"
        "  eth0:    5000      10    0    0    0     0          0         0     7000   12"
        "    0    0    0     0       0          0\n"
    )
    assert nic.nic_bytes(text) == 12000
    assert nic.nic_bytes(text, "lo") == 200
    assert nic.nic_bytes(text, "eth1") is None


def test_bytes_between_interpolates_and_needs_samples_around_the_window() -> None:
    series = [(0.0, 0), (1.0, 100), (2.0, 300)]
    assert nic.bytes_between(series, 0.5, 1.5) == pytest.approx(150.0)
    assert nic.bytes_between(series, 0.0, 2.0) == 300.0
    assert nic.bytes_between(series, 0.5, 2.5) is None  # no sample after the window's end
    assert nic.bytes_between(series[:1], 0.0, 0.0) is None


def test_the_sampler_counts_its_samples_inside_a_window() -> None:
    sampler = nic.NicSampler({})
    sampler.samples = [(t, {}) for t in (0.0, 0.25, 0.5, 0.75, 1.0)]
    assert sampler.samples_within(0.1, 0.9) == 3
    assert sampler.samples_within(0.3, 0.4) == 0  # a window between two samples
    assert sampler.samples_within(0.0, 1.0) == 5


def test_the_window_is_the_one_steady_rate_measures() -> None:
    # Two ranks, 10 steps each (warm-up 2): rank 1 starts 0.5 s later and ends later.
    runs = [c.Series(r, [float(i) for i in range(10)], [100.0 * (i + 1) for i in range(10)],
                     [0.0] * 10, 1000.0 + 0.5 * r) for r in (0, 1)]  # fmt: skip
    run = c.Run(runs, [])
    t0, t1 = nic.window_bounds(run)
    assert (t0, t1) == (1002.5, 1009.0)
    rate, window = c.steady_rate(run)
    assert window == pytest.approx(t1 - t0)


def test_peaks_per_worker_and_per_shard() -> None:
    got = sh.peak_fields({"worker": [3, 1, 2], "shard": [5, 4]})
    assert got["peak_bytes_per_worker"] == [1, 2, 3] and got["peak_worker_bytes"] == 3
    assert got["peak_bytes_per_shard"] == [4, 5] and got["peak_shard_bytes"] == 5
    ddp = sh.peak_fields({"worker": [7, 7]})
    assert ddp["peak_bytes_per_shard"] == [] and ddp["peak_shard_bytes"] is None


def test_the_sampler_reads_the_peak_of_a_psar_process_below_it() -> None:
    """A real `python -m psar.worker.cli train` child holding 200 MB: its VmHWM is read
    (role from its argv) before it exits."""
    hold = (
        "import time; b = bytearray(200 << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep(1.5)"
    )
    # role() reads the argv: the child's looks like a psar rank's (`-c` code before it).
    argv = [sys.executable, "-c", hold, "-m", "psar.worker.cli", "train"]
    with sh.sampler() as mem:
        p = subprocess.Popen(argv)
        assert p.wait(timeout=30) == 0
    peaks = sh.peak_fields(mem.by_role())
    assert len(peaks["peak_bytes_per_worker"]) == 1
    assert peaks["peak_worker_bytes"] >= 200 << 20


def test_ddp_holds_the_table_on_every_rank_and_the_shards_hold_one_copy(monkeypatch) -> None:
    monkeypatch.setattr(sh, "DATA_BYTES_PER_ROW", 0)  # the tables alone (the data: below)
    rows, dim = [50_000_000, 100_000], 64
    table = sum(rows) * dim * 4  # 12.83 GB
    ddp = sh.predict("allreduce_sparse", rows, dim, world=2, shards=2, base=0)
    extra = sh.DDP_EXTRA  # gloo and DDP's own, beyond a PS worker's
    assert ddp["worker_bytes"] == table + extra and ddp["total_bytes"] == 2 * (table + extra)
    dense = sh.predict("allreduce_dense", rows, dim, world=2, shards=2, base=0)
    assert dense["worker_bytes"] == 2 * table + extra
    for way in ("ps_sparse", "hybrid"):
        ps = sh.predict(way, rows, dim, world=2, shards=2, base=0)
        assert ps["worker_bytes"] == 0 and ps["shard_bytes"] == table // 2
        assert ps["total_bytes"] == table
    adam = sh.predict("hybrid", rows, dim, world=2, shards=2, row_state=2.0, base=0)
    assert adam["total_bytes"] == 3 * table  # lazy_adam: m and v per element
    # TorchRec row-wise (it runs on the hosts too): each rank its share of every table.
    tr = sh.predict("torchrec", rows, dim, world=2, shards=2, base=0)
    assert tr["worker_bytes"] == table // 2 + extra and tr["shard_bytes"] == 0
    assert tr["total_bytes"] == table + 2 * extra
    with pytest.raises(ValueError, match="unknown way"):
        sh.predict("allreduce_torchrec", rows, dim, world=2, shards=2)


def test_every_worker_is_charged_for_generating_its_data() -> None:
    ps = sh.predict("ps_sparse", [50_000_000, 100_000], 64, world=2, shards=2, base=0)
    assert ps["worker_bytes"] == 50_000_000 * sh.DATA_BYTES_PER_ROW  # 0.8 GB at 50M rows
    assert (
        ps["shard_bytes"]
        == sh.predict("ps_sparse", [50_000_000, 100_000], 64, world=2, shards=2, base=0)[
            "shard_bytes"
        ]
    )
    assert ps["shard_bytes"] == (50_100_000 * 64 * 4) // 2  # shards generate no data


def test_at_50m_rows_on_24_gb_ddp_sparse_is_skipped_and_the_ps_runs() -> None:
    rows = [50_000_000, 100_000]
    skip = sh.guard("allreduce_sparse", rows, 64, 2, 2, available=22 * GB)
    assert skip and not skip["predicted_fit"] and "predicted not to fit" in skip["skipped"]
    assert skip["predicted"]["total_bytes"] > 25 * GB
    assert sh.guard("hybrid", rows, 64, 2, 2, available=22 * GB) is None
    assert sh.guard("ps_sparse", rows, 64, 2, 2, available=22 * GB) is None
    # Other jobs holding 10 GB: the shards' 12.8 GB no longer fit either.
    assert sh.guard("hybrid", rows, 64, 2, 2, available=12 * GB) is not None


def test_a_predicted_skip_counts_as_ddp_not_fitting_without_an_oom() -> None:
    skip = sh.guard("allreduce_sparse", [50_000_000, 100_000], 64, 2, 2, available=22 * GB)
    fits = sparse._fits(12_800_000_000, skip)
    assert not fits["fits"] and not fits["oom"] and fits["predicted_fit"] is False
    out = {"ddp_sparse_fits": fits, "hybrid": {"samples_per_sec": 1.0}}
    assert sparse._goal(50_000_000, out)["why"] == "DDP-sparse did not fit"
    assert sparse._goal_hybrid(50_000_000, out)["met"]


def test_hosts_ratios_use_nic_bytes_and_judge_the_hosts_goal() -> None:
    out = {"workers": 4, "link_mbit": 1000.0,
           "hybrid": {"samples_per_sec": 130.0, "nic_bytes_per_step_per_worker": 2.0},
           "ps_sparse": {"samples_per_sec": 90.0, "nic_bytes_per_step_per_worker": None},
           "allreduce_sparse": {"samples_per_sec": 100.0, "nic_bytes_per_step_per_worker": 6.0}}  # fmt: skip
    sh.ratios(out)
    assert out["hybrid_vs_allreduce_sparse"] == {"bytes_ratio": 3.0, "speedup": 1.3,
                                                 "speedups": [1.3]}  # fmt: skip
    assert out["ps_vs_allreduce_sparse"]["bytes_ratio"] is None
    assert out["goal_hosts"]["met"] and out["goal_hosts"]["need_speedup"] == 1.3
    assert "hybrid_vs_torchrec" not in out and not out["goal_hosts_torchrec"]["met"]
    # With TorchRec run too: its goal (hybrid >= 1.0x TorchRec) from the paired repeats.
    out["torchrec"] = {"samples_per_sec": 140.0}
    runs = {w: [out[w]] for w in sh.HOST_WAYS}
    runs["hybrid"].append({"samples_per_sec": 150.0})
    runs["torchrec"].append({"samples_per_sec": 100.0})
    sh.ratios(out, runs)
    assert out["hybrid_vs_torchrec"]["speedups"] == [130.0 / 140.0, 1.5]
    assert out["goal_hosts_torchrec"]["need_speedup"] == 1.0


@pytest.mark.slow  # three jobs of real processes in namespaces: about a minute on 2 cores
def test_hosts_mode_runs_every_way_across_namespaces(tmp_path: Path) -> None:
    from tests import netns

    if reason := netns.unavailable_reason():
        pytest.skip(reason)
    t0 = time.monotonic()
    out = tmp_path / "hosts.json"
    argv = [sys.executable, "bench/sparse.py", "--hosts", "2", "--shards", "1", "--rows", "10000",
            "--batch", "128", "--steps", "12", "--link-mbit", "1000", "--timeout", "240",
            "--out", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)  # fmt: skip
    try:
        _, err = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()  # SIGKILL skips the bench's own teardown: the check below would say
    assert p.returncode == 0, err[-3000:]
    r = json.loads(out.read_text())["results"][0]
    assert (r["workers"], r["shard_hosts"], r["link_mbit"]) == (2, 1, 1000.0)
    assert r["link"]["gbps"] > 0
    tr = r["torchrec"]  # where its venv loads (bench/baselines/torchrec_venv.sh), else a skip
    if "skipped" in tr:
        assert "torchrec" in tr["skipped"].lower(), tr
    else:
        assert "error" not in tr, tr.get("error")
        assert tr["samples_per_sec"] > 0 and tr["nic_bytes_per_step_per_worker"] > 0
    for way in ("ps_sparse", "hybrid", "allreduce_sparse"):
        row = r[way]
        assert "error" not in row, row.get("error")
        assert row["samples_per_sec"] > 0
        assert len(row["peak_bytes_per_worker"]) == 2 and row["peak_worker_bytes"] > 100 << 20
        assert row["nic_bytes_per_step_per_worker"] > 0  # rows cross the emulated links
        # 12 steps (~0.1 s): a window of a few NIC samples or fewer; the bench warns when
        # under MIN_NIC_SAMPLES (its bytes read low), and only then.
        short = row["nic_samples_in_window"] < sh.MIN_NIC_SAMPLES
        assert short == (f"warning: {way}'s training window" in err), (row, err[-2000:])
    assert len(r["ps_sparse"]["peak_bytes_per_shard"]) == 1
    assert r["hybrid"]["nic_bytes_per_step_per_shard_host"] > 0
    assert r["allreduce_sparse"]["peak_bytes_per_shard"] == []
    assert "speedup" in r["hybrid_vs_allreduce_sparse"]
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mine = f"{netns.PREFIX}{p.pid}-"  # tests/netns.py names its namespaces by the pid
    assert not [n for n in left.split() if n.startswith(mine)], "namespaces left behind"
    print(f"hosts mode: {time.monotonic() - t0:.1f}s")


def test_repeats_pair_the_ways_of_one_repeat_and_keep_the_median() -> None:
    hyb = [
        {"samples_per_sec": x, "nic_bytes_per_step_per_worker": 2.0} for x in (60.0, 150.0, 120.0)
    ]
    ddp = [
        {"samples_per_sec": x, "nic_bytes_per_step_per_worker": 6.0} for x in (100.0, 100.0, 50.0)
    ]
    out = {"workers": 4, "link_mbit": 1000.0, "hybrid": sh.median_run(hyb),
           "allreduce_sparse": sh.median_run(ddp)}  # fmt: skip
    assert out["hybrid"]["samples_per_sec"] == 120.0
    assert out["hybrid"]["repeats_samples_per_sec"] == [60.0, 150.0, 120.0]
    sh.ratios(out, {"hybrid": hyb, "allreduce_sparse": ddp})
    got = out["hybrid_vs_allreduce_sparse"]
    assert got["speedups"] == [0.6, 1.5, 2.4] and got["speedup"] == 1.5  # per repeat
    assert out["goal_hosts"]["met"]
    failed = sh.median_run([{"error": "boom"}])
    assert failed == {"error": "boom"} and sh.median_run([]) == {}


@pytest.mark.slow  # two jobs of real processes in namespaces: ~20 s on 2 cores
def test_shards_on_the_workers_hosts_serve_rows_across_the_links(tmp_path: Path) -> None:
    from tests import netns

    if reason := netns.unavailable_reason():
        pytest.skip(reason)
    out = tmp_path / "hosts.json"
    argv = [sys.executable, "bench/sparse.py", "--hosts", "2", "--shards", "2", "--rows", "10000",
            "--batch", "128", "--steps", "60", "--link-mbit", "1000", "--timeout", "240",
            "--shard-placement", "worker-hosts", "--ways", "hybrid,allreduce_sparse",
            "--out", str(out)]  # fmt: skip
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(out.read_text())["results"][0]
    assert (r["hosts"], r["shard_hosts"], r["shard_placement"]) == (2, 0, "worker-hosts")
    hyb = r["hybrid"]
    assert "error" not in hyb, hyb.get("error")
    assert (
        len(hyb["peak_bytes_per_shard"]) == 2 and hyb["nic_bytes_per_step_per_shard_host"] is None
    )
    # Half of each worker's rows are on the other host's shard, and its host's shard serves
    # the other worker's half: a host's NIC carries about its worker's own row bytes
    # (0.93-0.98x measured). The window's ends are interpolated between NIC samples, so it
    # must span a few: sampled every 0.25 s, 12 steps (~0.1 s) read 0.30-0.47, diluted by
    # idle time, and 60 steps in CI (0.48 s) spanned 2; every 0.05 s, they span ~10.
    assert hyb["nic_samples_in_window"] >= sh.MIN_NIC_SAMPLES, p.stderr[-2000:]
    assert 0.6 * hyb["bytes_per_step"] < hyb["nic_bytes_per_step_per_worker"]
    assert hyb["nic_bytes_per_step_per_worker"] < 1.5 * hyb["bytes_per_step"]
    assert r["hybrid_vs_allreduce_sparse"]["speedup"] > 0
