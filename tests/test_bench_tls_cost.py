"""bench/experiments/tls_cost.py: a tiny real run over every wire (two processes each,
real TLS): each transfer's bytes arrive intact and both ends report CPU per GiB. No test
asserts a figure."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl command line")
def test_tls_cost_runs_every_wire(tmp_path: Path) -> None:
    out = tmp_path / "tls.json"
    cmd = [sys.executable, "-m", "bench.experiments.tls_cost", "--gib", "0.01",
           "--frame-mib", "1", "--repeats", "1", "--json", str(out)]  # fmt: skip
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert [r["wire"] for r in runs] == ["tcp", "sslsocket", "sealed"]
    for r in runs:
        assert r["send_s_per_gib"] > 0 and r["recv_s_per_gib"] > 0, r
    assert runs[1]["tls"].startswith("TLSv1.")
    for wire in ("tcp", "sslsocket", "sealed"):
        assert f"| {wire} |" in res.stdout


def test_tls_cost_names_a_bad_wire() -> None:
    cmd = [sys.executable, "-m", "bench.experiments.tls_cost", "--wires", "tcp,quic"]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (
        res.returncode == 2 and "--wires" in res.stderr and "tcp, sslsocket, sealed" in res.stderr
    )
