"""Metric name/type contract of ShardMetrics and WorkerMetrics, serving, and the deploy
files that refer to them (dashboard, scrape config)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from psar.ps.server.metrics.prometheus import (
    DURATION_BUCKETS,
    REJECT_REASONS,
    RPC_METHODS,
    STALENESS_BUCKETS,
    ShardMetrics,
    serve_metrics,
    stop_metrics,
)
from psar.worker.metrics import PHASES, WorkerMetrics

ROOT = Path(__file__).resolve().parents[1]
STALENESS = [0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64]

# The contract: exposed family name -> type (the parser strips _total from counters).
SHARD_CONTRACT = {
    **dict.fromkeys(
        "psar_ps_updates_applied psar_ps_rounds_skipped psar_ps_pushes_rejected "
        "psar_ps_pushes_accepted psar_ps_nonfinite_dropped psar_ps_bytes_received "
        "psar_ps_bytes_sent psar_ps_params_updated psar_ps_update_seconds "
        "psar_ps_membership_changes psar_ps_data_batches_dealt "
        "psar_ps_data_batches_returned".split(),
        "counter",
    ),
    **dict.fromkeys(
        "psar_ps_gradient_staleness psar_ps_rpc_duration_seconds "
        "psar_ps_barrier_wait_seconds psar_ps_ssp_wait_seconds".split(),
        "histogram",
    ),
    **dict.fromkeys(
        "psar_ps_live_workers psar_ps_version psar_ps_loss_scale psar_ps_master_bytes "
        "psar_ps_max_workers psar_ps_data_batches_remaining psar_build_info".split(),
        "gauge",
    ),
}
WORKER_CONTRACT = {
    **dict.fromkeys(
        "psar_worker_samples psar_worker_steps psar_worker_overflow_steps "
        "psar_worker_outer_rounds".split(),
        "counter",
    ),
    **dict.fromkeys(
        "psar_worker_step_phase_seconds psar_worker_observed_staleness".split(), "histogram"
    ),
    **dict.fromkeys(
        "psar_worker_loss psar_worker_loss_scale psar_build_info psar_worker_outer_round_bytes "
        "psar_worker_sync_drift psar_worker_world_size".split(),
        "gauge",
    ),
}
CONTRACT_REJECT = (
    "bad_shape bad_dtype unknown_key duplicate out_of_order too_stale nonfinite "
    "not_initialized unauthenticated too_large malformed other"
).split()


def samples(text: bytes | str, sample: str | None = None, **labels: str) -> list:
    """Parsed samples (named ``sample`` if given) whose labels include ``labels``."""
    text = text.decode() if isinstance(text, bytes) else text
    return [
        s
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if sample in (None, s.name) and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def families(text: bytes | str) -> dict:
    text = text.decode() if isinstance(text, bytes) else text
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(text: bytes, sample: str, **labels: str) -> float:
    """The value of the first sample matching ``sample`` and ``labels`` (others ignored)."""
    found = samples(text, sample, **labels)
    if not found:
        raise KeyError(f"{sample}{labels}")
    return found[0].value


def sample_names(text: bytes) -> set[str]:
    return {s.name for s in samples(text)}


def bucket_bounds(text: bytes, sample: str, **labels: str) -> list[float]:
    return sorted({float(s.labels["le"]) for s in samples(text, sample, **labels)})


@pytest.mark.parametrize(
    ("make", "contract"),
    [
        (lambda: ShardMetrics(shard=3, mode="async"), SHARD_CONTRACT),
        (lambda: WorkerMetrics(arch="ps"), WORKER_CONTRACT),
        (lambda: WorkerMetrics(arch="allreduce"), WORKER_CONTRACT),
    ],
)
def test_contract_present_before_any_event(make, contract):
    fams = families(make().exposition())
    for name, typ in contract.items():
        assert name in fams, f"{name} missing before any event"
        assert fams[name].type == typ, f"{name}: {fams[name].type} != {typ}"
        assert fams[name].samples, f"{name} has no samples before any event"
    for name, fam in fams.items():
        assert name.startswith("psar_"), name
        if name.endswith("_created"):  # per-series creation timestamps of the client
            continue
        if fam.type == "counter":
            assert all(s.name.endswith(("_total", "_created")) for s in fam.samples), name


def test_children_created_at_start():
    text = ShardMetrics().exposition()
    for reason in CONTRACT_REJECT:
        assert value(text, "psar_ps_pushes_rejected_total", reason=reason) == 0
    assert value(text, "psar_ps_rounds_skipped_total", reason="overflow") == 0
    methods = ("Init", "GetJob", "Push", "Pull", "Leave", "Stats")
    for method in methods:
        assert value(text, "psar_ps_rpc_duration_seconds_count", method=method) == 0
    assert set(REJECT_REASONS) >= set(CONTRACT_REJECT) and set(methods) <= set(RPC_METHODS)
    wtext = WorkerMetrics(arch="allreduce").exposition()
    for phase in ("data", "forward", "backward", "push", "pull", "wait", "allreduce", "optimizer"):
        assert value(wtext, "psar_worker_step_phase_seconds_count", phase=phase) == 0
    assert set(PHASES) >= {"data", "optimizer", "allreduce"}


def test_build_info():
    text = ShardMetrics().exposition()
    fam = families(text)["psar_build_info"]
    [s] = fam.samples
    assert s.value == 1 and s.labels["arch"] == "ps" and s.labels["version"]
    [w] = families(WorkerMetrics(arch="allreduce").exposition())["psar_build_info"].samples
    assert w.labels["arch"] == "allreduce"


def test_histogram_buckets_exact():
    s = ShardMetrics()
    text = s.exposition()
    inf = float("inf")
    assert list(STALENESS_BUCKETS) == STALENESS
    assert bucket_bounds(text, "psar_ps_gradient_staleness_bucket") == [*STALENESS, inf]
    w = WorkerMetrics(arch="ps").exposition()
    assert bucket_bounds(w, "psar_worker_observed_staleness_bucket") == [*STALENESS, inf]
    for name in ("rpc_duration_seconds", "barrier_wait_seconds", "ssp_wait_seconds"):
        bounds = bucket_bounds(text, f"psar_ps_{name}_bucket")
        assert bounds == [*DURATION_BUCKETS, inf]
        assert bounds[0] <= 0.0001 and bounds[-2] >= 60
    assert bucket_bounds(w, "psar_worker_step_phase_seconds_bucket", phase="data")[0] <= 0.0001


def test_shard_counters_move():
    m = ShardMetrics(shard=1, mode="sync")
    for staleness in (0, 5):
        m.optimizer_step()
        m.gradient_applied(staleness)
    m.push_accepted()
    m.round_skipped("overflow")
    m.round_skipped("who-knows")
    m.push_rejected("too_stale")
    m.push_rejected("definitely-not-a-reason")
    m.nonfinite_dropped()
    m.chunk_applied_early()
    m.chunk_applied_early()
    m.chunk_undo()
    m.early_pull_ended(3, False)
    m.early_pull_ended(2, True)
    m.bytes_received(100)
    m.bytes_sent(250)
    m.update_timed(1000, 0.25)
    m.update_timed(1000, 0.25)
    m.rpc_observed("Push", 0.002)
    m.rpc_observed("Bogus", 0.002)
    m.barrier_wait(0.3)
    m.ssp_wait(1.5)
    for change in ("joined", "joined", "left", "expired"):
        m.membership_changed(change)
    m.data_dealt(3, remaining=17)
    m.data_returned(2)
    gauges = {
        "live_workers": 4,
        "max_workers": 6,
        "version": 7,
        "loss_scale": 1024,
        "master_bytes": 4096,
    }
    for name, v in gauges.items():
        getattr(m, f"set_{name}")(v)
    t = m.exposition()
    assert value(t, "psar_ps_updates_applied_total", shard="1", mode="sync") == 2
    assert value(t, "psar_ps_gradient_staleness_count") == 2
    assert value(t, "psar_ps_gradient_staleness_sum") == 5
    assert value(t, "psar_ps_gradient_staleness_bucket", le="0.0") == 1
    assert value(t, "psar_ps_gradient_staleness_bucket", le="4.0") == 1
    assert value(t, "psar_ps_gradient_staleness_bucket", le="6.0") == 2
    assert value(t, "psar_ps_pushes_accepted_total") == 1
    assert value(t, "psar_ps_rounds_skipped_total", reason="overflow") == 1
    assert value(t, "psar_ps_rounds_skipped_total", reason="other") == 1
    assert value(t, "psar_ps_pushes_rejected_total", reason="too_stale") == 1
    assert value(t, "psar_ps_pushes_rejected_total", reason="other") == 1
    assert value(t, "psar_ps_pushes_rejected_total", reason="malformed") == 0
    assert value(t, "psar_ps_nonfinite_dropped_total") == 1
    assert value(t, "psar_ps_chunks_applied_early_total") == 2
    assert value(t, "psar_ps_chunk_undos_total") == 1
    assert value(t, "psar_ps_early_pull_slots_total") == 5
    assert value(t, "psar_ps_early_pull_voids_total") == 1
    assert value(t, "psar_ps_bytes_received_total") == 100
    assert value(t, "psar_ps_bytes_sent_total") == 250
    assert value(t, "psar_ps_params_updated_total") == 2000
    assert value(t, "psar_ps_update_seconds_total") == pytest.approx(0.5)
    assert value(t, "psar_ps_rpc_duration_seconds_count", method="Push") == 1
    assert value(t, "psar_ps_rpc_duration_seconds_count", method="other") == 1
    assert value(t, "psar_ps_rpc_duration_seconds_count", method="Pull") == 0
    assert value(t, "psar_ps_barrier_wait_seconds_sum") == pytest.approx(0.3)
    assert value(t, "psar_ps_ssp_wait_seconds_count") == 1
    assert all(value(t, f"psar_ps_{name}") == v for name, v in gauges.items())
    assert value(t, "psar_ps_membership_changes_total", change="joined") == 2
    assert value(t, "psar_ps_membership_changes_total", change="left") == 1
    assert value(t, "psar_ps_membership_changes_total", change="expired") == 1
    assert value(t, "psar_ps_membership_changes_total", change="rejoining") == 0
    assert value(t, "psar_ps_data_batches_dealt_total") == 3
    assert value(t, "psar_ps_data_batches_remaining") == 17
    assert value(t, "psar_ps_data_batches_returned_total") == 2
    # Unexpected label values must not have created new series (bounded cardinality).
    assert "who-knows" not in t.decode() and "Bogus" not in t.decode()


def test_worker_counters_move():
    m = WorkerMetrics(arch="ps")
    m.step_done(32)
    m.step_done(32)
    m.phase("forward", 0.01)
    m.phase("nonsense", 0.01)
    with m.time_phase("data"):
        pass
    m.set_loss(2.5)
    m.set_loss_scale(65536)
    m.overflow_step()
    m.observed_staleness(3)
    m.observed_staleness(None)
    m.set_world_size(3)
    t = m.exposition()
    assert value(t, "psar_worker_samples_total", arch="ps") == 64
    assert value(t, "psar_worker_steps_total") == 2
    assert value(t, "psar_worker_step_phase_seconds_count", phase="forward") == 1
    assert value(t, "psar_worker_step_phase_seconds_count", phase="other") == 1
    assert value(t, "psar_worker_step_phase_seconds_count", phase="data") == 1
    assert value(t, "psar_worker_loss") == 2.5
    assert value(t, "psar_worker_loss_scale") == 65536
    assert value(t, "psar_worker_overflow_steps_total") == 1
    assert value(t, "psar_worker_observed_staleness_count") == 1
    assert value(t, "psar_worker_world_size") == 3
    assert all(s.labels.get("arch") == "ps" for s in samples(t))


def test_instances_do_not_share_state():
    a, b = ShardMetrics(shard=0), ShardMetrics(shard=0)
    a.optimizer_step()
    assert value(a.exposition(), "psar_ps_updates_applied_total") == 1
    assert value(b.exposition(), "psar_ps_updates_applied_total") == 0
    wa, wb = WorkerMetrics(arch="ps"), WorkerMetrics(arch="ps")
    wa.step_done(10)
    assert value(wb.exposition(), "psar_worker_samples_total") == 0
    reg = CollectorRegistry()
    assert ShardMetrics(reg).registry is reg


def test_set_mode_relabels_without_losing_counts():
    m = ShardMetrics(shard=1)  # the server starts before Init tells it the mode
    m.push_rejected("not_initialized")
    m.set_mode("ssp")
    m.ssp_wait(0.5)
    t = m.exposition()
    assert value(t, "psar_ps_pushes_rejected_total", mode="ssp", reason="not_initialized") == 1
    assert value(t, "psar_ps_ssp_wait_seconds_count", mode="ssp", shard="1") == 1
    assert 'mode="sync"' not in t.decode()
    with pytest.raises(ValueError):
        m.set_mode("ddp")


def test_error_reasons_are_known():
    # Every reason psar.ps.errors can report is a pre-created series, not lumped into "other".
    errors = pytest.importorskip("psar.ps.errors")
    stack, reasons = [errors.PSError], set()
    while stack:
        cls = stack.pop()
        reasons.add(cls.reason)
        stack.extend(cls.__subclasses__())
    assert reasons <= set(REJECT_REASONS)


def test_one_metrics_object_per_registry():
    reg = CollectorRegistry()
    ShardMetrics(reg)
    with pytest.raises(ValueError, match="Duplicated"):
        ShardMetrics(reg, shard=1)


def test_bad_construction_arguments():
    with pytest.raises(ValueError):
        ShardMetrics(mode="ddp")
    with pytest.raises(ValueError):
        WorkerMetrics(arch="gpu")


def test_names_carry_units():
    # Contract names put the unit where Prometheus style wants it, except the
    # counters psar_ps_bytes_{received,sent}_total, whose names the contract fixes.
    for text in (ShardMetrics().exposition(), WorkerMetrics(arch="ps").exposition()):
        for name, fam in families(text).items():
            if name.endswith("_created"):  # client-library timestamps, not ours
                continue
            if fam.type == "histogram" and "staleness" not in name:
                # Every non-staleness histogram is a duration (staleness is in versions).
                assert name.endswith("_seconds"), name
            if "byte" in name:
                assert "_bytes" in name, name
            # Base units only: seconds and bytes, never ms/us/kb.
            assert not re.search(r"_(ms|milliseconds|us|micro\w*|kb|mb|kib|mib)(_|$)", name), name


def test_serve_port0_and_scrape_over_http():
    m = ShardMetrics(shard=2)
    m.optimizer_step()
    server, thread = serve_metrics(m.registry, 0)
    try:
        port = server.server_port
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            body = resp.read()
        assert value(body, "psar_ps_updates_applied_total", shard="2") == 1
        assert set(SHARD_CONTRACT) <= set(families(body))
    finally:
        stop_metrics(server, thread)
    assert not thread.is_alive()


def test_worker_serve_shortcut():
    w = WorkerMetrics(arch="allreduce")
    server, thread = w.serve(0)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            assert "psar_worker_samples_total" in resp.read().decode()
    finally:
        stop_metrics(server, thread)


@pytest.mark.parametrize("kind", ["shard", "worker"])
def test_promtool_check_metrics(kind):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    m = ShardMetrics() if kind == "shard" else WorkerMetrics(arch="ps")
    out = subprocess.run(
        [promtool, "check", "metrics"],
        input=m.exposition(),
        capture_output=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()


def test_dashboard_refers_only_to_existing_metrics():
    dash = json.loads((ROOT / "deploy/grafana/psar-dashboard.json").read_text())
    assert dash["uid"] == "psar-overview"
    [ds] = [v for v in dash["templating"]["list"] if v["name"] == "datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    exposed = sample_names(ShardMetrics().exposition()) | sample_names(
        WorkerMetrics(arch="ps").exposition()
    )
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", []) if t.get("expr")]
    assert len(exprs) >= 8
    referenced = {n for e in exprs for n in re.findall(r"\bpsar_[a-z0-9_]+", e)}
    missing = referenced - exposed
    assert not missing, f"dashboard refers to unknown metrics: {sorted(missing)}"
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
    # The panels the dashboard promises.
    assert any("rate(psar_worker_samples_total[1m])" in e and "arch, instance" in e for e in exprs)
    assert any("psar_ps_gradient_staleness_bucket" in e for e in exprs)
    assert any("psar_worker_observed_staleness_bucket" in e for e in exprs)
    assert any("histogram_quantile" in e and "barrier_wait" in e for e in exprs)
    assert any("histogram_quantile" in e and "ssp_wait" in e for e in exprs)
    # Elastic jobs (docs/elastic.md): world size and membership changes.
    [panel] = [p for p in dash["panels"] if p["title"] == "World size and membership changes"]
    world = [t["expr"] for t in panel["targets"]]
    assert any("psar_ps_live_workers" in e for e in world)
    assert any("psar_ps_membership_changes_total" in e and "change" in e for e in world)


def test_prometheus_configs_parse():
    cfg = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    targets = jobs["psar-local"]["static_configs"][0]["targets"]
    assert targets == [f"localhost:{p}" for p in range(9400, 9408)]
    relabel = json.dumps(jobs["psar-pods"]["relabel_configs"])
    for ann in ("scrape", "port", "path"):
        assert f"__meta_kubernetes_pod_annotation_prometheus_io_{ann}" in relabel
    pm = yaml.safe_load((ROOT / "deploy/prometheus/podmonitor.yaml").read_text())
    assert pm["kind"] == "PodMonitor"
    assert pm["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/part-of": "psar"}


def test_promtool_check_config(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    path = ROOT / "deploy/prometheus/prometheus.yml"

    def check(p: Path) -> subprocess.CompletedProcess:
        cmd = [promtool, "check", "config", str(p)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30)

    out = check(path)
    if "kubernetes_sd_configs not found" in out.stdout + out.stderr:
        # Debian's prometheus package is built without Kubernetes service discovery:
        # check everything else (the static job, globals) and leave the pods job to
        # the yaml test above.
        cfg = yaml.safe_load(path.read_text())
        cfg["scrape_configs"] = [
            j for j in cfg["scrape_configs"] if "kubernetes_sd_configs" not in j
        ]
        reduced = tmp_path / "prometheus.yml"
        reduced.write_text(yaml.safe_dump(cfg))
        out = check(reduced)
    assert out.returncode == 0, out.stdout + out.stderr
