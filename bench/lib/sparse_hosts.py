"""bench/sparse.py's multi-host mode and its memory accounting (issue #46 item 4).

- **Peak memory per process** (`peak_fields`): the VmHWM of every `psar train` rank and
  `psar server` shard below the benchmark, sampled from /proc while a way runs
  (bench/lib/memory.py's PeakSampler; torchrun's agent is left out, its ranks are its
  children), as sorted lists per worker and per shard.
- **Fit prediction** (`predict`, `guard`): what each process of a way must hold for a
  table (DDP: every rank the whole table, twice for dense gradients; ps and hybrid: each
  shard its share, each worker only its dense layers and row cache), checked against
  MemAvailable before the way starts, so a 50M-row run that cannot fit is skipped with
  the prediction stated instead of pushing a shared machine into the OOM killer.
- **Emulated hosts** (`bench_hosts`, `--hosts N --link-mbit M`): N workers, each in a
  network namespace of its own, and one host per shard, on a bridge whose every port tc
  shapes both ways to M Mbit/s (tests/netns.py, bench/lib/netem.py: the links grid's
  hosts). ps_sparse, hybrid, allreduce_sparse and torchrec (where its venv loads:
  bench/lib/torchrec_way.py) run on the same model and data; DDP's, hybrid's and
  TorchRec's gloo ranks are started one per host with MASTER_ADDR on w0 (as the links
  grid starts DDP). Bytes per step are counted on the NICs (`nic_*`: tx + rx of eth0 over
  the job, divided by the steps), so DDP-sparse's sparse allgather is measured, not
  estimated, and every way pays its TCP/IP and RPC overhead alike.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.lib import common as c
from bench.lib import nic
from bench.lib.memory import PeakSampler

#: The ways the hosts mode runs (allreduce_dense would allreduce the whole table).
HOST_WAYS = ("ps_sparse", "hybrid", "allreduce_sparse", "torchrec")
#: Resident bytes of a psar process before any table or batch: torch, gRPC, gloo, the
#: data set of a short run (measured 0.3-0.45 GB per rank on this machine; rounded up).
PROCESS_BASE = 500 << 20
#: Bytes per table row every worker allocates while it generates its data: the Zipf
#: sampler's float64 ranks and their cumulative sum (worker/workloads/recsys.py
#: zipf_ids; measured: a PS worker's peak 0.47 GB at 1M rows, 1.16 GB at 50M).
DATA_BYTES_PER_ROW = 16
#: What a DDP rank holds beyond a PS worker besides its table (gloo, DDP's buckets and
#: set-up): a rank's VmHWM was a PS worker's + the table + 0.30 GB at 1M rows and
#: + 0.03 GB at 10M (2 ranks; 2026-12-06); rounded up.
DDP_EXTRA = 512 << 20
#: Left free for the other jobs of a shared machine and the page cache.
MARGIN = 2 << 30


#: Where the hosts mode puts the shards (`--shard-placement`): a host of their own each
#: (more hosts and NICs than DDP's ranks have), or on the workers' hosts, shard i beside
#: worker i % N (ps-lite's and MXNet's way: servers on the trainers' machines, as TorchRec
#: keeps its shards in the trainers' memory; the same hosts and NICs as DDP's).
PLACEMENTS = ("own-hosts", "worker-hosts")
#: NIC samples a way's training window must span for its NIC bytes to be read as its
#: own (fewer: interpolated across the idle time around it, the figure reads low).
MIN_NIC_SAMPLES = 3


def host_names(workers: int, shards: int, placement: str = "own-hosts") -> list[str]:
    """The emulated hosts: w0..w{n-1} for the workers, and s0..s{k-1}, one per shard,
    unless the shards share the workers' hosts."""
    if workers < 1 or shards < 1:
        raise ValueError(f"--hosts needs workers >= 1 and shards >= 1, got {workers}, {shards}")
    if placement not in PLACEMENTS:
        raise ValueError(f"--shard-placement: accepted: {', '.join(PLACEMENTS)}; got {placement!r}")
    own = [f"s{i}" for i in range(shards)] if placement == "own-hosts" else []
    return [*(f"w{r}" for r in range(workers)), *own]


def shard_host_names(workers: int, shards: int, placement: str = "own-hosts") -> list[str]:
    """The host each shard runs on, shard by shard."""
    if placement == "worker-hosts":
        return [f"w{i % workers}" for i in range(shards)]
    return [f"s{i}" for i in range(shards)]


def predict(way: str, table_rows: list[int], dim: int, world: int, shards: int,
            row_state: float = 0.0, base: int = PROCESS_BASE) -> dict[str, Any]:  # fmt: skip
    """Bytes each process of `way` must hold and their sum. DDP ranks hold every table
    and DDP_EXTRA (allreduce_dense: and the table's dense gradient); a shard holds 1/shards of
    the rows with `row_state` more fp32 per element; PS and hybrid workers hold their
    dense layers and a row cache, which `base` covers (momentum 0: no dense optimizer
    state); every worker also generates its data (DATA_BYTES_PER_ROW of its largest
    table)."""
    table = sum(table_rows) * dim * 4
    data = max(table_rows) * DATA_BYTES_PER_ROW  # a worker's, one table's ids at a time
    if way in ("allreduce_sparse", "allreduce_dense"):
        worker = base + data + DDP_EXTRA + table * (1 + (way == "allreduce_dense"))
        shard, n_shards = 0, 0
    elif way in ("ps_sparse", "hybrid"):
        worker = base + data
        shard, n_shards = base + int(table * (1 + row_state) / shards), shards
    elif way == "torchrec":  # row-wise: each rank its share of every table
        worker = base + data + DDP_EXTRA + table // world
        shard, n_shards = 0, 0
    else:
        raise ValueError(f"unknown way {way!r}")
    return {"worker_bytes": worker, "shard_bytes": shard,
            "total_bytes": world * worker + n_shards * shard}  # fmt: skip


def mem_available() -> int:
    """MemAvailable (bytes): what can be allocated without swapping out anyone's pages."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable")


def guard(way: str, table_rows: list[int], dim: int, world: int, shards: int,
          available: int | None = None, margin: int = MARGIN,
          row_state: float = 0.0) -> dict[str, Any] | None:  # fmt: skip
    """None when `way` is predicted to fit MemAvailable less `margin`; else the row to
    record instead of running it ("skipped", with the prediction)."""
    need = predict(way, table_rows, dim, world, shards, row_state)
    avail = mem_available() if available is None else available
    if need["total_bytes"] <= avail - margin:
        return None
    return {"skipped": f"predicted not to fit: {need['total_bytes'] / 1e9:.2f} GB for "
                       f"{world} workers" + (f" + {shards} shards" if need["shard_bytes"] else "")
                       + f" > {avail / 1e9:.2f} GB available - {margin / 1e9:.1f} GB margin",
            "predicted": need, "available_bytes": avail, "predicted_fit": False}  # fmt: skip


def peak_fields(by_role: dict[str, list[int]]) -> dict[str, Any]:
    """A row's memory columns from PeakSampler.by_role(): VmHWM per worker and per shard
    (sorted), and the largest of each (None where the way has no such process)."""
    workers, shards = sorted(by_role.get("worker", [])), sorted(by_role.get("shard", []))
    return {"peak_bytes_per_worker": workers, "peak_bytes_per_shard": shards,
            "peak_worker_bytes": max(workers, default=None),
            "peak_shard_bytes": max(shards, default=None)}  # fmt: skip


def sampler() -> PeakSampler:
    """A VmHWM sampler cheap enough for 2 shared cores (VmHWM only grows: a slower poll
    misses nothing but a process's last quarter second)."""
    return PeakSampler(every=0.25)


def measured(way: str, table_rows: list[int], dim: int, world: int, shards: int,
             run: Callable[[], dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """`run()`'s row (bench/sparse.py's one-host ways) with the VmHWM of each worker and
    shard, or the skip `guard` predicts from this machine's memory (at 50M rows the
    shards hold 12.8 GB)."""
    if skip := guard(way, table_rows, dim, world, shards):
        return skip
    with sampler() as mem:
        row = run()
    return {**row, **peak_fields(mem.by_role())}


def train_args(table_rows: list[int], dim: int, bag: int, batch: int, steps: int,
               world: int, options: tuple[str, ...] = ()) -> list[str]:  # fmt: skip
    """`psar train` flags shared by every way: bench/sparse.py's, for `world` workers."""
    opts = ["--workload-option", f"rows={table_rows[0]},{table_rows[1]}",
            "--workload-option", f"dim={dim}", "--workload-option", f"bag={bag}",
            "--workload-option", f"samples={batch * world * (steps + 1)}",
            "--workload-option", "val_samples=0",
            *(a for o in options for a in ("--workload-option", o))]  # fmt: skip
    return ["train", "--workload", "recsys", *opts, "--steps", str(steps),
            "--batch-size", str(batch), "--precision", "fp32", "--lr", "0.05",
            "--momentum", "0", "--eval-batches", "0", "--log-every", "0",
            "--torch-threads", "1"]  # fmt: skip


def row_flags(dtype: str) -> list[str]:
    """psar's flags for the rows of ps and hybrid (`--row-dtype`): gradients pushed and
    rows pulled in `dtype`. fp32 (the default) moves DDP-sparse's bytes, so the two
    compare at one precision; fp16 halves them (the shards keep fp32 masters)."""
    return ["--sparse-wire-dtype", dtype, "--sparse-pull-dtype", dtype]


def _rank_env(r: int, world: int, master: Any, port: int) -> dict[str, str]:
    """torchrun's variables for rank r alone on its host (gloo on the host's NIC)."""
    return {"RANK": str(r), "LOCAL_RANK": "0", "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": master.addr, "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": master.ifname}  # fmt: skip


def _torchrec_argv(python: str, inputs: Path, run_dir: Path, report: Path) -> list[str]:
    """One TorchRec rank, started alone on its host (the runner reads torchrun's
    variables from the environment: _rank_env)."""
    from bench.lib import torchrec_way

    return [python, str(torchrec_way.RUNNER), "--inputs", str(inputs), "--run-dir",
            str(run_dir), "--report", str(report)]  # fmt: skip


def run_way(way: str, d: Path, lan: Any, common: list[str], world: int, shards: int,
            timeout: float, row_dtype: str = "fp32",
            torchrec: tuple[str, Path] | None = None,
            placement: str = "own-hosts") -> dict[str, Any]:  # fmt: skip
    """One way on the LAN: its rate over the window every worker trains, bytes on the
    NICs per step, peak memory per process, the final loss."""
    workers = [lan[f"w{r}"] for r in range(world)]
    run_dir = d / way
    report = run_dir / "report-{rank}.json"
    with c.supervisor(d / f"{way}-logs") as sup, sampler() as mem:
        addrs: list[str] = []
        if way not in ("allreduce_sparse", "torchrec"):
            on_hosts = shard_host_names(world, shards, placement)
            addrs = c.start_shards(sup, shards, hosts=[lan[n] for n in on_hosts])
        port = c.free_port()
        for r, h in enumerate(workers):
            if way == "torchrec":
                assert torchrec is not None  # bench_hosts gives (python, inputs)
                env = c.child_env(_rank_env(r, world, workers[0], port))
                argv = _torchrec_argv(*torchrec, run_dir, run_dir / "report-0.json")
                sup.start(f"worker{r}", c.on(h, argv), env=env)
                continue
            if way == "ps_sparse":
                argv = [*c.PSAR, *common, "--arch", "ps", "--mode", "sync",
                        "--servers", ",".join(addrs), "--rank", str(r),
                        "--world-size", str(world)]  # fmt: skip
                env = c.child_env()
            else:
                arch = (["--arch", "hybrid", "--mode", "sync", "--servers", ",".join(addrs)]
                        if way == "hybrid" else
                        ["--arch", "allreduce", "--workload-option", "sparse=true",
                         "--optimizer-impl", "loop"])  # fmt: skip
                argv = [*c.PSAR, *common, *arch]
                env = c.child_env(_rank_env(r, world, workers[0], port))
            argv += ["--wire-dtype", "fp32", "--report", str(report), "--run-dir", str(run_dir)]
            if way != "allreduce_sparse":
                argv += row_flags(row_dtype)
            sup.start(f"worker{r}", c.on(h, argv), env=env)
        # A process that sleeps in each host for the job's length: the NICs' counters stay
        # readable through /proc/PID/net/dev after a worker has exited.
        shard_hosts = [n for n in host_names(world, shards, placement) if n.startswith("s")]
        hosts = [f"w{r}" for r in range(world)] + (shard_hosts if addrs else [])
        for n in hosts:
            sup.start(f"nic-{n}", c.on(lan[n], ["sleep", str(int(timeout) + 60)]), persistent=True)
        pids = {n: sup.children[f"nic-{n}"].pid for n in hosts}
        with nic.NicSampler(pids) as counters:
            sup.wait([f"worker{r}" for r in range(world)], timeout)
    steps = int(common[common.index("--steps") + 1])
    run = c.load_run(run_dir)
    rate, window = c.steady_rate(run)
    t0, t1 = nic.window_bounds(run)
    # Steps one worker took in the window (all take the same share in a sync job).
    per_worker_steps = rate * window / (world * int(common[common.index("--batch-size") + 1]))
    moved = {n: counters.between(n, t0, t1) for n in pids}
    inside = counters.samples_within(t0, t1)
    if inside < MIN_NIC_SAMPLES:
        print(f"warning: {way}'s training window ({t1 - t0:.2f} s) spans {inside} NIC "
              f"sample(s) of {counters.every} s: its NIC bytes read low; give it more --steps",
              file=sys.stderr)  # fmt: skip

    def mean(xs: list[float | None]) -> float | None:
        if not xs or None in xs or not per_worker_steps > 0:  # no window (NaN rate): no figure
            return None
        return sum(xs) / len(xs) / per_worker_steps  # type: ignore[arg-type]

    rep = json.loads((run_dir / "report-0.json").read_text())
    return {
        "samples_per_sec": rate, "window_s": window, "steps": steps,
        "report_samples_per_sec": rep.get("global_samples_per_sec"),
        "nic_bytes_per_step_per_worker": mean([moved[f"w{r}"] for r in range(world)]),
        "nic_samples_in_window": inside,
        # Shards on the workers' hosts: their bytes are in the workers' NICs' figure.
        "nic_bytes_per_step_per_shard_host": mean([moved[n] for n in shard_hosts]) if addrs
        and shard_hosts else None,
        "bytes_per_step": _app_bytes(way, rep, steps),
        "worker_model_bytes": rep.get("worker_param_bytes"),
        "final_loss": rep.get("final_train_loss"),
        **peak_fields(mem.by_role()),
        # TorchRec's ranks are no psar processes for the sampler: their own peaks.
        **({"peak_rss_bytes_per_rank": [x["peak_rss_bytes"] for x in rep.get("ranks", [])]}
           if way == "torchrec" else {}),
    }  # fmt: skip


def _app_bytes(way: str, rep: dict[str, Any], steps: int) -> float | None:
    """Bytes per step per worker as psar counts them (DDP-sparse: none are counted for
    gloo's sparse allreduce, so its NIC figure is the one to read)."""
    if way == "ps_sparse":
        return (rep["bytes_pushed"] + rep["bytes_pulled"]) / steps
    if way == "hybrid":
        return (rep["bytes_sent"] + rep["bytes_received"]) / steps
    return None  # its report's bytes_allreduced counts the tables as dense


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One way's row from its repeats: the run of the median rate (the lower of two),
    with every repeat's rate in run order; an error row when none ran."""
    ok = sorted((r for r in runs if "samples_per_sec" in r), key=lambda r: r["samples_per_sec"])
    if not ok:
        return runs[-1] if runs else {}
    return {**ok[(len(ok) - 1) // 2],
            "repeats_samples_per_sec": [r.get("samples_per_sec") for r in runs]}  # fmt: skip


def ratios(out: dict[str, Any], runs: dict[str, list[dict[str, Any]]] | None = None) -> None:
    """`{ps,hybrid}_vs_allreduce_sparse`: NIC bytes, and the median over the repeats of
    each repeat's rate ratio (ways run back to back in a repeat: a shared machine's
    drift hits them alike); then the hosts goal."""
    runs = runs or {w: [out[w]] for w in HOST_WAYS if w in out}
    base = out.get("allreduce_sparse", {})
    for way, key in (("ps_sparse", "ps"), ("hybrid", "hybrid")):
        mine = out.get(way, {})
        if "samples_per_sec" in base and "samples_per_sec" in mine:
            theirs, ours = (x.get("nic_bytes_per_step_per_worker") for x in (base, mine))
            each = [a["samples_per_sec"] / b["samples_per_sec"]
                    for a, b in zip(runs.get(way, []), runs.get("allreduce_sparse", []))  # noqa: B905
                    if "samples_per_sec" in a and "samples_per_sec" in b]  # fmt: skip
            out[f"{key}_vs_allreduce_sparse"] = {
                "bytes_ratio": theirs / ours if theirs and ours else None,
                "speedup": c.median(each),
                "speedups": each,
            }
    tr, hyb = out.get("torchrec", {}), out.get("hybrid", {})
    if "samples_per_sec" in tr and "samples_per_sec" in hyb:
        each = [a["samples_per_sec"] / b["samples_per_sec"]
                for a, b in zip(runs.get("hybrid", []), runs.get("torchrec", []))  # noqa: B905
                if "samples_per_sec" in a and "samples_per_sec" in b]  # fmt: skip
        out["hybrid_vs_torchrec"] = {"speedup": c.median(each), "speedups": each}
    got = out.get("hybrid_vs_allreduce_sparse", {}).get("speedup")
    vs_tr = out.get("hybrid_vs_torchrec", {}).get("speedup")
    out["goal_hosts_torchrec"] = {"need_speedup": 1.0, "speedup": vs_tr,
                                  "met": vs_tr is not None and vs_tr >= 1.0,
                                  "row_dtype": out.get("row_dtype", "fp32"),
                                  "why": "hybrid / TorchRec samples/s"}  # fmt: skip
    out["goal_hosts"] = {"need_speedup": 1.3, "speedup": got,
                         "met": got is not None and got >= 1.3,
                         "row_dtype": out.get("row_dtype", "fp32"),
                         "why": f"hybrid / DDP-sparse samples/s, {out['workers']} hosts at "
                                f"{out['link_mbit']:g} Mbit/s"}  # fmt: skip


def bench_hosts(rows: int, *, steps: int, batch: int, bag: int, workers: int, shards: int,
                mbit: float, timeout: float, ways: tuple[str, ...], out_dir: Path,
                options: tuple[str, ...] = (), repeats: int = 1,
                row_dtype: str = "fp32", torchrec_python: str = "",
                placement: str = "own-hosts") -> dict[str, Any]:  # fmt: skip
    """One table size over emulated hosts: every way in `ways` (of HOST_WAYS) in turn on
    the same shaped LAN, `repeats` times alternating; skips (with the reason) where
    namespaces cannot be made."""
    from bench.lib.netem import probe_link, shape_all, unavailable

    table_rows, dim = [rows, 100_000 if rows >= 1_000_000 else 10_000], 64
    names = host_names(workers, shards, placement)
    out: dict[str, Any] = {"rows": table_rows, "dim": dim, "bag": bag, "batch_per_worker": batch,
                           "workers": workers, "shards": shards,
                           "shard_hosts": len(names) - workers, "shard_placement": placement,
                           "hosts": len(names), "link_mbit": mbit, "steps": steps,
                           "options": list(options), "row_dtype": row_dtype}  # fmt: skip
    netns, reason = unavailable(0.0)
    if reason:
        return {**out, "skipped": reason}
    common = train_args(table_rows, dim, bag, batch, steps, workers, options)
    with netns.lan(names) as lan:  # deleted on exit, failure too
        shape_all(netns, lan, mbit, 0.0)
        with c.supervisor(out_dir / "probe") as sup:
            out["link"] = probe_link(sup, lan["w0"], lan[names[-1]], 16 << 20)
        runs: dict[str, list[dict[str, Any]]] = {}
        torchrec = None
        for way in ways:
            if way == "torchrec":
                from bench.lib import torchrec_way

                if why := torchrec_way.unusable(torchrec_python):
                    out[way] = {"skipped": why}
                    continue
                inputs = out_dir / f"{rows}-torchrec-inputs"
                opts = [
                    a for i, a in enumerate(common) if i and common[i - 1] == "--workload-option"
                ]
                torchrec_way.write_inputs(inputs, [x for o in opts for x in ("--workload-option", o)],
                                          batch, steps, workers, lr=0.05)  # fmt: skip
                torchrec = (torchrec_python, inputs)
            if skip := guard(way, table_rows, dim, workers, shards):
                out[way] = skip
            else:
                runs[way] = []
        for i in range(repeats):
            for way in runs:
                c.log(f"sparse hosts: {rows:,} rows, {way}, {workers} workers at {mbit:g} "
                      f"Mbit/s [{i + 1}/{repeats}]")  # fmt: skip
                try:
                    runs[way].append(run_way(way, out_dir / f"{rows}-{i}", lan, common, workers,
                                             shards, timeout, row_dtype, torchrec,
                                             placement))  # fmt: skip
                except c.ProcessError as e:  # one failed way costs its row, not the others
                    runs[way].append({"error": str(e)[-3000:]})
    out.update({way: median_run(got) for way, got in runs.items()})
    out["repeats"] = repeats
    ratios(out, runs)
    return out


def table(results: list[dict[str, Any]]) -> str:
    """The hosts mode's rows: one per table size and way."""
    head = ["table rows", "way", "samples/s", "vs DDP-sparse", "NIC MB/step/worker",
            "NIC MB/step/shard host", "psar MB/step", "peak GB/worker", "peak GB/shard"]  # fmt: skip
    rows = []
    gb = lambda x: None if x is None else x / 1e9  # noqa: E731
    mb = lambda x: None if x is None else x / 1e6  # noqa: E731
    for r in results:
        for way in HOST_WAYS:
            w = r.get(way, {})
            key = {"ps_sparse": "ps", "hybrid": "hybrid"}.get(way, "")
            rows.append([f"{r['rows'][0]:,}", way,
                         w.get("samples_per_sec") or w.get("skipped") or w.get("error", "-")[:80],
                         r.get(f"{key}_vs_allreduce_sparse", {}).get("speedup"),
                         mb(w.get("nic_bytes_per_step_per_worker")),
                         mb(w.get("nic_bytes_per_step_per_shard_host")),
                         mb(w.get("bytes_per_step")), gb(w.get("peak_worker_bytes")),
                         gb(w.get("peak_shard_bytes"))])  # fmt: skip
    r0 = results[0] if results else {}
    return ("## Sparse tables over emulated hosts\n\n" + c.md_table(head, rows)
            + f"\n\n{r0.get('workers')} worker hosts, {r0.get('shard_hosts')} shard hosts "
            f"(shards on {r0.get('shard_placement', 'own-hosts')}), "
            f"{r0.get('link_mbit')} Mbit/s links; rates over the window every worker trains in.")  # fmt: skip


def main_hosts(a: Any) -> int:
    """--hosts N: every table size over emulated hosts (bench/lib/sparse_hosts.py)."""
    ways = tuple(w for w in (x.strip() for x in a.ways.split(",")) if w in HOST_WAYS)
    sizes = [10_000] if a.quick else [int(r) for r in a.rows.split(",")]
    steps, batch = (6, 256) if a.quick else (a.steps, a.batch)
    c.install_sigterm()  # a SIGTERM unwinds through netns.lan(): no namespace is left
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        results = [
            bench_hosts(n, steps=steps, batch=batch, bag=a.bag, workers=a.hosts,
                           shards=a.shards, mbit=a.link_mbit, timeout=a.timeout, ways=ways,
                           out_dir=Path(tmp), options=tuple(a.workload_option),
                           repeats=a.repeats, row_dtype=a.row_dtype,
                           torchrec_python=a.torchrec_python,
                           placement=a.shard_placement)
            for n in sizes
        ]  # fmt: skip
    doc = {"benchmark": "sparse", "mode": "hosts", "quick": a.quick,
           "seconds": time.time() - t0, "machine": c.machine(), "results": results,
           "table": table(results)}  # fmt: skip
    text = json.dumps(doc, indent=2)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0
