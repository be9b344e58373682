"""Smoke runs of bench/ps_datapath.py and bench/baselines/tcp.py: they run end to end
and print the JSON they promise. No timing is asserted (CI machines are noisy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\nstderr:\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.slow  # CI's slow stage runs it; the default run stays under 10 min
def test_ps_datapath_quick_json_schema(tmp_path: Path) -> None:
    proc = _run(
        ["-m", "bench.ps_datapath", "--quick", "--sizes", "1", "--shards", "1,2", "--json",
         "--out", str(tmp_path)],
        timeout=240,
    )  # fmt: skip
    doc = json.loads(proc.stdout)
    assert doc["benchmark"] == "ps_datapath" and (tmp_path / "ps_datapath.json").exists()
    rows = doc["results"]
    assert isinstance(rows, list)
    assert [(r["payload_mib"], r["shards"], r["transport"]) for r in rows] == [
        (1.0, 1, "grpc"),
        (1.0, 1, "tcp"),
        (1.0, 2, "grpc"),
        (1.0, 2, "tcp"),
    ]
    for r in rows:
        for key in ("payload_mib", "shards", "transport", "gbps", "ratio_to_tcp"):
            assert key in r, key
        assert isinstance(r["shards"], int)
        for key in ("gbps", "ratio_to_tcp", "push_gbps", "pull_gbps", "tcp_gbps"):
            assert isinstance(r[key], float) and r[key] > 0, (key, r[key])
        assert abs(r["ratio_to_tcp"] - r["gbps"] / r["tcp_gbps"]) < 0.01
        assert r["repeats"] >= 1


@pytest.mark.slow
def test_ps_datapath_table_and_bad_flags(tmp_path: Path) -> None:
    proc = _run(
        [str(ROOT / "bench" / "ps_datapath.py"), "--quick", "--sizes", "0.25", "--shards", "1",
         "--out", str(tmp_path)],
        timeout=240,
    )  # fmt: skip
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "## PS data path"
    assert "push+pull GB/s" in lines[2] and "x raw TCP" in lines[2]
    assert [x.strip() for x in lines[4].split("|")[1:4]] == ["0.25", "1", "grpc"]
    # the shards' own logs, one folder per (size, shards)
    assert (tmp_path / "0.25mib-1shards" / "shard0.log").exists()

    bad = subprocess.run(
        [sys.executable, "-m", "bench.ps_datapath", "--shards", "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--shards" in bad.stderr


def test_tcp_baseline_json() -> None:
    proc = _run(["-m", "bench.baselines.tcp", "--sizes", "1", "--repeats", "1", "--json"],
                timeout=60)  # fmt: skip
    (row,) = json.loads(proc.stdout)
    assert row["payload_mib"] == 1.0 and row["tcp_gbps"] > 0
