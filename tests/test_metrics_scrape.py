"""Real runs scraped over HTTP while they train and after: 2 shards + 2 PS workers, and
a 2-rank DDP job. The exposition is parsed with prometheus_client's own parser."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.procs import ENV, PSAR, _kill, free_port, shards

STEPS, BATCH = 16, 8


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called `name` whose labels include `labels`."""
    return sum(
        v for (n, lab), v in samples(text).items() if n == name and set(labels.items()) <= set(lab)
    )


def wait_for(port: int, name: str, at_least: float, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            text = scrape(port)
            if value(text, name) >= at_least:
                return text
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{name} never reached {at_least} on port {port}")
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ps_job_scraped_during_and_after(tmp_path, mode: str) -> None:
    shard_ports = [free_port(), free_port()]
    worker_ports = [free_port(), free_port()]
    chunked = ["--chunk-rounds"] if mode == "sync" else []  # async: the flag changes nothing
    with shards(2, *chunked, metrics_ports=shard_ports) as addrs:
        # Before any job arrives every series already exists (children created at start).
        empty = scrape(shard_ports[0])
        for name in ("psar_ps_updates_applied_total", "psar_ps_pushes_rejected_total",
                     "psar_ps_gradient_staleness_bucket", "psar_build_info"):  # fmt: skip
            assert any(n == name for n, _ in samples(empty)), name
        procs = []
        try:
            for r in range(2):
                args = [*PSAR, "train", "--arch", "ps", "--servers", ",".join(addrs),
                        "--rank", str(r), "--world-size", "2", "--mode", mode,
                        "--steps", str(STEPS), "--batch-size", str(BATCH), "--precision", "fp32",
                        "--eval-batches", "0", "--log-every", "0", "--torch-threads", "1",
                        "--metrics-port", str(worker_ports[r]), "--metrics-linger-s", "60"]  # fmt: skip
                if r == 1:
                    args += ["--slowdown", "4"]  # an uneven worker
                log = open(tmp_path / f"w{r}.log", "w")  # noqa: SIM115
                procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=ENV,
                                              start_new_session=True))  # fmt: skip
            wait_for(worker_ports[1], "psar_worker_steps_total", 1)  # scraped while it trains
            finals = [wait_for(p, "psar_worker_steps_total", STEPS) for p in worker_ports]
        finally:
            time.sleep(0.5)
            shard_texts = [scrape(p) for p in shard_ports]
            for p in procs:
                _kill(p)
    for text in finals:
        assert value(text, "psar_worker_samples_total", arch="ps") == STEPS * BATCH
        assert value(text, "psar_worker_steps_total", arch="ps") == STEPS
        assert value(text, "psar_build_info", arch="ps") == 1
    for text in shard_texts:
        applied = value(text, "psar_ps_updates_applied_total")
        accepted = value(text, "psar_ps_pushes_accepted_total")
        stale_count = value(text, "psar_ps_gradient_staleness_count")
        stale_zero = value(text, "psar_ps_gradient_staleness_bucket", le="0.0")
        assert value(text, "psar_ps_pushes_rejected_total") == 0
        assert value(text, "psar_ps_master_bytes") > 0
        assert value(text, "psar_ps_bytes_received_total") > 0
        assert value(text, "psar_ps_bytes_sent_total") > 0
        assert stale_count == accepted == 2 * STEPS
        if mode == "sync":
            assert applied == STEPS == value(text, "psar_ps_version")  # one update per round
            assert stale_zero == stale_count  # staleness is always 0
            assert value(text, "psar_ps_barrier_wait_seconds_count") > 0
            # Per-chunk rounds: slots updated before rounds closed, none undone (no
            # overflow, no refusal).
            assert value(text, "psar_ps_chunks_applied_early_total") > 0
            assert value(text, "psar_ps_chunk_undos_total") == 0
        else:
            assert applied == accepted == 2 * STEPS  # one update per accepted push
            assert stale_zero < stale_count  # the uneven worker makes stale gradients
            assert value(text, "psar_ps_chunks_applied_early_total") == 0
    for text in finals:
        obs = value(text, "psar_worker_observed_staleness_count")
        assert obs == STEPS


@pytest.mark.slow
def test_ddp_job_scraped(tmp_path) -> None:
    base = free_port()
    while not all(_port_free(base + i) for i in range(2)):
        base = free_port()
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "psar.worker.cli", "train", "--arch", "allreduce", "--steps", str(STEPS),
            "--batch-size", str(BATCH), "--precision", "fp32", "--eval-batches", "0",
            "--log-every", "0", "--torch-threads", "1", "--slowdown", "2",
            "--metrics-port", str(base), "--metrics-linger-s", "60"]  # fmt: skip
    log = open(tmp_path / "ddp.log", "w")  # noqa: SIM115
    p = subprocess.Popen(
        args, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
    )
    try:
        wait_for(base, "psar_worker_steps_total", 1)  # while it trains
        texts = [wait_for(base + r, "psar_worker_steps_total", STEPS) for r in range(2)]
    finally:
        _kill(p)
    for text in texts:
        assert value(text, "psar_worker_samples_total", arch="allreduce") == STEPS * BATCH
        assert (
            value(text, "psar_worker_step_phase_seconds_count", arch="allreduce", phase="forward")
            == STEPS
        )
        assert value(text, "psar_build_info", arch="allreduce") == 1


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_a_live_shard_exposition() -> None:
    port = free_port()
    with shards(1, metrics_ports=[port]):
        text = scrape(port)
    r = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
