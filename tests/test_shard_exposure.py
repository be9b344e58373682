"""Exposure is a decision, and a job's counts are bounded (issue #45, defect 6).

`psar server --bind 0.0.0.0:50051` with no token and no TLS used to start (and --dry-run
said rc 0), the log saying only "(plaintext)"; Init took a job of 2^20 workers. Now a
shard or /metrics listening beyond loopback without a token and TLS refuses to start,
naming the flags, unless --allow-insecure-bind says so; --dry-run checks the same; and
Init refuses counts above --max-job-workers / --max-job-slots, naming the flag."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import grpc
import pytest

from psar.ps.client.client_config import ClientConfig
from psar.ps.client.errors import PSClientError
from psar.ps.client.psclient import PSClient
from psar.ps.errors import InvalidArgument
from psar.ps.partition import plan_slots
from psar.ps.server.limits import ShardLimits
from psar.ps.server.shard import ShardState
from psar.worker import cli
from tests.fault_procs import ENV, PSAR, Shard
from tests.ps_fixtures import init_values, make_job

EXPOSED = [
    (["--bind", "0.0.0.0:50051"], "--auth-token-file and TLS"),
    (["--bind", "[::]:50051"], "--auth-token-file and TLS"),
    (["--bind", "10.1.2.3:50051", "--auth-token-file", "t"], "without TLS (--tls-cert"),
    (["--bind", "shardhost:50051"], "--allow-insecure-bind"),
    (["--metrics-port", "9400", "--metrics-addr", "0.0.0.0"], "--metrics-addr 0.0.0.0"),
]


@pytest.mark.parametrize(("argv", "words"), EXPOSED)
def test_dry_run_refuses_an_exposed_shard_naming_the_flags(capsys, argv, words) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as e:
        cli.main(["server", "--dry-run", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "--allow-insecure-bind" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--bind", "0.0.0.0:50051", "--allow-insecure-bind"],
        ["--metrics-port", "9400", "--metrics-addr", "0.0.0.0", "--allow-insecure-bind"],
        ["--bind", "10.1.2.3:1", "--auth-token-file", "t", "--tls-cert", "c", "--tls-key", "k"],
        ["--bind", "127.0.0.2:50051", "--metrics-port", "9400"],
        ["--bind", "[::1]:50051"],
        ["--bind", "localhost:50051"],
    ],
)
def test_loopback_a_token_and_tls_or_the_decision_start(argv: list[str]) -> None:
    assert cli.main(["server", "--dry-run", *argv]) == 0


def test_a_real_exposed_shard_refuses_to_start() -> None:
    p = subprocess.run([*PSAR, "server", "--bind", "0.0.0.0:0"], env=ENV, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode != 0
    assert "--allow-insecure-bind" in p.stderr and "listening" not in p.stdout


def _job(workers: int, slots: int = 1):  # noqa: ANN202
    job = make_job("sync", num_workers=2)
    if slots > 1:
        job = dataclasses.replace(job, slots=plan_slots([("w", slots)], 1, chunk_bytes=4))
    return dataclasses.replace(job, num_workers=workers)


def test_init_bounds_the_counts_a_job_declares() -> None:
    big = _job(1 << 20)
    st = ShardState()
    with pytest.raises(InvalidArgument, match="1048576 workers.*--max-job-workers"):
        st.init(big, init_values(big))
    assert not st.initialized
    elastic = dataclasses.replace(_job(2), max_workers=5000)
    with pytest.raises(InvalidArgument, match="5000 workers"):
        ShardState().check_job(elastic)
    assert ShardState(limits=ShardLimits(max_job_workers=5000)).check_job(elastic) is False
    many = _job(2, slots=300)
    with pytest.raises(InvalidArgument, match="300 slots.*--max-job-slots"):
        ShardState(limits=ShardLimits(max_job_slots=299)).check_job(many)


def test_a_real_shard_refuses_a_huge_job_at_init_and_takes_one_after(tmp_path: Path) -> None:
    shard = Shard(0, tmp_path, "--max-job-workers", "8")
    shard.start()
    try:
        cfg = ClientConfig(timeout_s=30, retry_timeout_s=30, data_plane="grpc")
        for workers, ok in ((9, False), (8, True)):
            job = _job(workers)
            with PSClient([shard.address], worker=0, cfg=cfg) as c:
                c.set_slots(job.slots)
                if ok:
                    c.init([job], init_values(job))
                    continue
                with pytest.raises(PSClientError) as e:
                    c.init([job], init_values(job))
                assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert "--max-job-workers" in str(e.value)
    finally:
        shard.stop()
