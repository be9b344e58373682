"""Architecture comparison: psar (ps sync with 1 and 2 shards, allreduce) against plain
baselines, step throughput at equal work.

In one process tree and one run, on the reference workload (MLP 784-1024-1024-10, batch
128 per worker, SGD momentum, fp32, one compute thread per process) with each worker
count: psar `--arch ps --mode sync` with 1 and 2 shards (defaults: overlap on, the TCP
data plane), the same with 1 shard and `--no-overlap`, with `psar server
--chunk-rounds` (per-chunk rounds), with `--data-plane grpc` and with
`--data-shm-mib 0` (the data plane's bytes in the socket, not shared memory: what each
contributes), psar `--arch allreduce`, a plain DDP script
(bench/baselines/plain_ddp.py), a plain RPC parameter server written the PyTorch RPC
tutorial's way (bench/baselines/rpc_ps.py), and a no-communication run (plain_ddp.py
--no-comm: the same processes doing the same compute and optimizer step, no DDP).
`--runs` picks rows, among them `rpc-ps-async` (the RPC server's per-parameter async
style, not run by default) and `psar-ps-sync-1-glibc-malloc` (the shard with
`--malloc-mmap-threshold-mib 0`: glibc's own mmap threshold, what that default costs or
saves). The configurations alternate A B C ... A B C ... over the
repeats; medians are reported.

samples/s = total samples over the window in which every worker trains, after each
one's warm-up steps (bench/lib/common.py steady_rate: a stall counts); the JSON also keeps
`median_samples_per_sec` (each worker's samples per step / its median step time, added
up: robust_rate, which hides stalls). Exposed communication per step, two ways: (1) median
step time - the no-communication run's median step time, measured alongside (the same
CPU contention, so it is what communication costs; works for every run); (2) for psar
PS runs, the median of the step phases push + wait + pull from the step logs: time the
training thread was blocked on communication (the rest was hidden behind compute).
Goals (issue #10, 2 workers): ps-sync >= 1.0x plain DDP and >= 1.3x the RPC pattern;
psar allreduce >= 0.97x plain DDP. The JSON's `goals` says what was reached.

--tls adds two rows with TLS on (a CA and a certificate for 127.0.0.1 made with the
openssl CLI; shard --tls-cert/--tls-key, workers --tls-ca): ps-sync over the TLS data plane
(psar-ps-sync-1-tls) and over gRPC (psar-ps-sync-1-tls-grpc, the only path before issue
#18), each as a ratio to psar-ps-sync-1 (no TLS) of the same run; goal (#18): the TLS data
plane >= 0.85x.

    python -m bench.step_throughput                  # 2 and 4 workers, 3 repeats
    python -m bench.step_throughput --quick --json   # 2 workers, 1 repeat
    python -m bench.step_throughput --quick --tls --repeats 3   # with the TLS rows
    python -m bench.step_throughput --tls-only   # no TLS, TLS records, sealed, gRPC TLS: 2 workers, 300 steps, 5 repeats
    python -m bench.step_throughput --workers 2 --runs plain-ddp,psar-allreduce --repeats 8
        # psar allreduce against plain DDP alone, 8 alternated pairs
    python -m bench.step_throughput --workers 2 --runs plain-ddp,rpc-ps,rpc-ps-async,psar-ps-sync-1
        # the torch RPC parameter servers, both styles
    python -m bench.step_throughput --memory   # peak bytes/param: PS worker vs DDP rank (104M)

--memory: what a worker must hold (bench/lib/memory.py): peak memory per worker in bytes
per parameter, PS (fp16 worker weights, AdamW on the shards) vs a DDP rank (fp32 AdamW),
beside `psar plan`'s memory rows; issue #36's goals in its JSON's `goals`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lib import common as c
from bench.lib import memory

CONFIGS = ("plain-ddp", "psar-allreduce", "psar-ps-sync-1", "psar-ps-sync-2",
           "psar-ps-sync-1-no-overlap", "psar-ps-sync-1-chunk-rounds",
           "psar-ps-sync-1-grpc", "psar-ps-sync-1-no-shm", "rpc-ps")  # fmt: skip
#: Rows `--runs` may add to the default ones.
EXTRA_CONFIGS = ("rpc-ps-async", "psar-ps-sync-1-early-pull", "psar-ps-sync-1-glibc-malloc")
NO_COMM = "no-comm"
BASELINE = "plain-ddp"
# Run folder prefix of each psar PS configuration (their step logs carry phases).
PS_DIRS = {"psar-ps-sync-1": "ps1", "psar-ps-sync-2": "ps2",
           "psar-ps-sync-1-no-overlap": "ps1-plain", "psar-ps-sync-1-grpc": "ps1-grpc",
           "psar-ps-sync-1-chunk-rounds": "ps1-chunks", "psar-ps-sync-1-no-shm": "ps1-noshm",
           "psar-ps-sync-1-early-pull": "ps1-early", "psar-ps-sync-1-glibc-malloc": "ps1-glibc"}  # fmt: skip
EXPOSED = ("push", "wait", "pull")
TLS_CONFIGS = ("psar-ps-sync-1-tls", "psar-ps-sync-1-tls-grpc")
PS_DIRS.update({"psar-ps-sync-1-tls": "ps1-tls", "psar-ps-sync-1-tls-grpc": "ps1-tls-grpc"})
TLS_GOAL = 0.85
"""Issue #18: ps-sync with TLS (the data plane) >= this x the same run without TLS."""


def make_certs(d: Path) -> dict[str, str]:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost (openssl CLI)."""
    d.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes")
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=ca")
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=server")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.pem", "-days", "1", "-extfile", "san.ext")  # fmt: skip
    return {k: str(d / f) for k, f in (("ca", "ca.pem"), ("cert", "server.pem"),
                                       ("key", "server.key"))}  # fmt: skip


def run_rpc(out: Path, workers: int, steps: int, timeout: float, style: str = "tutorial") -> c.Run:
    """bench/baselines/rpc_ps.py: rank 0 the server, `workers` trainers."""
    py = [str(c.ROOT / "bench" / "baselines" / "rpc_ps.py"), "--style", style,
          "--steps", str(steps), "--out", str(out)]  # fmt: skip
    return c.ddp_job(out, workers=workers + 1, py_args=py, timeout=timeout)


def run_ps(out: Path, workers: int, shards: int, steps: int, timeout: float,
           *extra: str, server: tuple[str, ...] = ()) -> c.Run:  # fmt: skip
    train = [*c.REF_TRAIN, "--steps", str(steps), *extra]
    return c.ps_job(out, workers=workers, shards=shards, mode="sync", train=train,
                    timeout=timeout, server=server)  # fmt: skip


def phase_ms(out: Path) -> dict[str, float]:
    """Median ms per step of each communication phase, averaged over the workers."""
    per: dict[str, list[float]] = {k: [] for k in (*EXPOSED, "exposed")}
    for path in sorted(out.glob("steps-ps-rank*.jsonl")):
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        recs = recs[c.warmup_steps(len(recs)) :]
        for k in EXPOSED:
            per[k].append(1e3 * c.median([r.get("phases", {}).get(k, 0.0) for r in recs]))
        per["exposed"].append(
            1e3 * c.median([sum(r.get("phases", {}).get(k, 0.0) for k in EXPOSED) for r in recs])
        )
    return {k: sum(v) / len(v) for k, v in per.items() if v}


def measure(
    out: Path,
    *,
    workers: int,
    steps: int,
    repeats: int,
    timeout: float,
    tls: bool = False,
    only: Sequence[str] | None = None,
) -> dict:
    """Every configuration (`only`: these rows, no-comm among them or not), alternated."""
    d = out / f"w{workers}"
    runs = {
        "no-comm": lambda i: c.plain_ddp_job(
            d / f"nocomm-{i}", workers, steps, timeout, local=True
        ),
        "plain-ddp": lambda i: c.plain_ddp_job(d / f"plain-{i}", workers, steps, timeout),
        "psar-allreduce": lambda i: c.psar_allreduce_job(
            d / f"allreduce-{i}", workers, steps, timeout
        ),
        "psar-ps-sync-1": lambda i: run_ps(d / f"ps1-{i}", workers, 1, steps, timeout),
        "psar-ps-sync-2": lambda i: run_ps(d / f"ps2-{i}", workers, 2, steps, timeout),
        "psar-ps-sync-1-no-overlap": lambda i: run_ps(
            d / f"ps1-plain-{i}", workers, 1, steps, timeout, "--no-overlap"
        ),
        "psar-ps-sync-1-chunk-rounds": lambda i: run_ps(
            d / f"ps1-chunks-{i}", workers, 1, steps, timeout, server=("--chunk-rounds",)
        ),
        "psar-ps-sync-1-grpc": lambda i: run_ps(
            d / f"ps1-grpc-{i}", workers, 1, steps, timeout, "--data-plane", "grpc"
        ),
        "psar-ps-sync-1-no-shm": lambda i: run_ps(
            d / f"ps1-noshm-{i}", workers, 1, steps, timeout, "--data-shm-mib", "0"
        ),
        "psar-ps-sync-1-early-pull": lambda i: run_ps(
            d / f"ps1-early-{i}",
            workers,
            1,
            steps,
            timeout,
            "--early-pull",
            server=("--chunk-rounds",),
        ),
        "psar-ps-sync-1-glibc-malloc": lambda i: run_ps(
            d / f"ps1-glibc-{i}",
            workers,
            1,
            steps,
            timeout,
            server=("--malloc-mmap-threshold-mib", "0"),
        ),  # fmt: skip
        "rpc-ps": lambda i: run_rpc(d / f"rpc-{i}", workers, steps, timeout),
        "rpc-ps-async": lambda i: run_rpc(d / f"rpca-{i}", workers, steps, timeout, "async"),
    }
    chosen = [NO_COMM, *CONFIGS] if only is None else list(only)
    chosen += ["psar-ps-sync-1"] if tls else []  # the TLS rows' baseline
    runs = {k: v for k, v in runs.items() if k in chosen}
    if tls:
        pem = make_certs(out / "certs")
        on = ("--tls-cert", pem["cert"], "--tls-key", pem["key"])
        ca = ("--tls-ca", pem["ca"])
        runs["psar-ps-sync-1-tls"] = lambda i: run_ps(
            d / f"ps1-tls-{i}", workers, 1, steps, timeout, *ca, "--data-plane", "tcp", server=on
        )
        runs["psar-ps-sync-1-tls-grpc"] = lambda i: run_ps(
            d / f"ps1-tls-grpc-{i}", workers, 1, steps, timeout, *ca, "--data-plane", "grpc",
            server=on,
        )  # fmt: skip
    got = c.alternate(runs, repeats)
    rate = {k: c.median([rate_of(r) for r in v]) for k, v in got.items()}
    step = {k: c.median([c.job_step_seconds(r) for r in v]) for k, v in got.items()}
    compute = step.get(NO_COMM)
    rows = {}
    for name in [k for k in (*CONFIGS, *EXTRA_CONFIGS, *TLS_CONFIGS) if k in got]:
        rows[name] = {
            "samples_per_sec": rate[name],
            "ratio_to_plain_ddp": _ratio(rate[name], rate.get(BASELINE)),
            "step_ms": 1e3 * step[name],
            "exposed_comm_ms": None if compute is None else 1e3 * (step[name] - compute),
            "per_repeat_samples_per_sec": [rate_of(r) for r in got[name]],
            "median_samples_per_sec": c.median([c.robust_rate(r) for r in got[name]]),
        }
        if name in PS_DIRS:
            phases = [phase_ms(d / f"{PS_DIRS[name]}-{i}") for i in range(repeats)]
            rows[name]["phase_ms"] = {
                k: c.median([p[k] for p in phases if k in p]) for k in (*EXPOSED, "exposed")
            }
            rows[name]["ratio_to_rpc"] = _ratio(rate[name], rate.get("rpc-ps"))
            if "rpc-ps-async" in rate:
                rows[name]["ratio_to_rpc_async"] = rate[name] / rate["rpc-ps-async"]
        if name in TLS_CONFIGS:
            rows[name]["ratio_to_ps_sync_1_no_tls"] = rate[name] / rate["psar-ps-sync-1"]
    return {"workers": workers, "steps": steps, "repeats": repeats,
            "compute_ms_no_comm": None if compute is None else 1e3 * compute,
            "no_comm_samples_per_sec": rate.get(NO_COMM), "runs": rows}  # fmt: skip


def _ratio(a: float, b: float | None) -> float | None:
    return a / b if b else None


def rate_of(run: c.Run) -> float:
    """Total samples / seconds over the window in which every worker trains."""
    return c.steady_rate(run)[0]


def measure_tls(out: Path, *, workers: int, steps: int, repeats: int, timeout: float) -> dict:
    """Only ps-sync 1 shard without TLS and the two TLS rows, alternated (--tls-only)."""
    d = out / f"w{workers}"
    pem = make_certs(out / "certs")
    on = ("--tls-cert", pem["cert"], "--tls-key", pem["key"])
    ca = ("--tls-ca", pem["ca"])
    runs = {
        "psar-ps-sync-1": lambda i: run_ps(d / f"ps1-{i}", workers, 1, steps, timeout),
        "psar-ps-sync-1-tls": lambda i: run_ps(
            d / f"ps1-tls-{i}", workers, 1, steps, timeout, *ca, "--data-plane", "tcp", server=on
        ),
        "psar-ps-sync-1-tls-grpc": lambda i: run_ps(
            d / f"ps1-tls-grpc-{i}", workers, 1, steps, timeout, *ca, "--data-plane", "grpc",
            server=on,
        ),
        # The opt-in (issue #33): psar's sealed records after the TLS hello.
        "psar-ps-sync-1-tls-sealed": lambda i: run_ps(
            d / f"ps1-tls-sealed-{i}", workers, 1, steps, timeout, *ca, "--data-plane", "tcp",
            server=(*on, "--data-sealed-records"),
        ),
    }  # fmt: skip
    got = c.alternate(runs, repeats)
    rate = {k: c.median([rate_of(r) for r in v]) for k, v in got.items()}
    med = {k: c.median([c.robust_rate(r) for r in v]) for k, v in got.items()}
    base = rate["psar-ps-sync-1"]
    rows = {
        name: {
            "samples_per_sec": rate[name],
            "ratio_to_ps_sync_1_no_tls": rate[name] / base,
            "step_ms": 1e3 * c.median([c.job_step_seconds(r) for r in got[name]]),
            "per_repeat_samples_per_sec": [rate_of(r) for r in got[name]],
            "median_samples_per_sec": med[name],
            "median_ratio_to_ps_sync_1_no_tls": med[name] / med["psar-ps-sync-1"],
        }
        for name in runs
    }
    return {"workers": workers, "steps": steps, "repeats": repeats, "runs": rows}


def tls_table(doc: dict) -> str:
    head = ["workers", "run", "samples/s", "x ps-sync-1 without TLS", "step ms"]
    rows = [[m["workers"], name, r["samples_per_sec"], r["ratio_to_ps_sync_1_no_tls"], r["step_ms"]]
            for m in doc["results"] for name, r in m["runs"].items()]  # fmt: skip
    m0 = doc["results"][0]
    lines = [f"- {k}: {c.fmt(g['measured'])} (goal >= {g['goal']}: {'met' if g['met'] else 'not met'})"
             for k, g in doc.get("goals", {}).items()]  # fmt: skip
    return (
        "## Step throughput with TLS (psar ps-sync, 1 shard)\n\n"
        + c.md_table(head, rows)
        + f"\n\nReference workload, {m0['steps']} steps per run, median of {m0['repeats']} "
        "alternated repeats; samples/s over the window in which every worker trains. -tls: "
        "shard --tls-cert/--tls-key, workers --tls-ca, the TLS data plane (--data-plane tcp) "
        "in standard TLS records (the default); -tls-sealed: the same with the shard's "
        "opt-in --data-sealed-records; -tls-grpc: the same over gRPC.\n\n" + "\n".join(lines)
    )


def tls_goals(results: list[dict]) -> dict:
    two = [m for m in results if m["workers"] == 2] or results
    v = two[0]["runs"]["psar-ps-sync-1-tls"]["ratio_to_ps_sync_1_no_tls"]
    return {"ps_sync_tls_over_no_tls": {"measured": v, "goal": TLS_GOAL, "met": v >= TLS_GOAL}}


def goals(results: list[dict]) -> dict:
    """Issue #10's goals, judged on the 2-worker results (those whose rows ran)."""
    two = [m for m in results if m["workers"] == 2]
    if not two:
        return {}
    runs = two[0]["runs"]
    ps1, ar, tls = (runs.get(k, {}) for k in ("psar-ps-sync-1", "psar-allreduce",
                                              "psar-ps-sync-1-tls"))  # fmt: skip
    got = {
        "ps_sync_over_plain_ddp": (ps1.get("ratio_to_plain_ddp"), 1.0),
        "ps_sync_over_rpc": (ps1.get("ratio_to_rpc"), 1.3),
        "allreduce_over_plain_ddp": (ar.get("ratio_to_plain_ddp"), 0.97),
        "ps_sync_tls_over_no_tls": (tls.get("ratio_to_ps_sync_1_no_tls"), TLS_GOAL),
    }
    return {k: {"measured": v, "goal": goal, "met": v >= goal}
            for k, (v, goal) in got.items() if v is not None}  # fmt: skip


def table(doc: dict) -> str:
    head = ["workers", "run", "samples/s", "x plain DDP", "x rpc-ps", "step ms",
            "exposed comm ms/step", "blocked on push / wait / pull ms"]  # fmt: skip
    rows = []
    for m in doc["results"]:
        if m.get("no_comm_samples_per_sec") is not None:
            rows.append([m["workers"], "no communication (compute only)",
                         m["no_comm_samples_per_sec"], None, None, m["compute_ms_no_comm"], 0.0,
                         None])  # fmt: skip
        for name, r in m["runs"].items():
            ph = r.get("phase_ms")
            split = " / ".join(c.fmt(ph[k]) for k in EXPOSED) if ph else None
            rows.append([m["workers"], name, r["samples_per_sec"], r["ratio_to_plain_ddp"],
                         r.get("ratio_to_rpc"), r["step_ms"], r["exposed_comm_ms"], split])  # fmt: skip
    m0 = doc["results"][0]
    lines = [f"- {k}: {c.fmt(g['measured'])} (goal >= {g['goal']}: {'met' if g['met'] else 'not met'})"
             for k, g in doc.get("goals", {}).items()]  # fmt: skip
    return (
        "## Step throughput (psar vs plain DDP vs a plain RPC parameter server)\n\n"
        + c.md_table(head, rows)
        + f"\n\nReference workload, {m0['steps']} steps per run, median of {m0['repeats']} "
        "alternated repeats. psar PS runs: overlap on (its trial keeps the fastest arm), whole "
        "rounds and the TCP data plane "
        "unless the name "
        "says otherwise. Exposed comm = step time - the no-communication run's step time "
        "(same processes, same contention). Blocked on push / wait / pull = medians of the "
        "psar step phases: time the training thread waited on communication.\n\n" + "\n".join(lines)
    )


def main(argv: list[str] | None = None) -> int:
    p = c.parser("python -m bench.step_throughput", __doc__)
    p.add_argument("--workers", default=None, help="comma-separated (default 2,4; quick 2)")
    p.add_argument("--steps", type=int, default=None,
                   help="per run (default 100; --tls-only 300; quick 30)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=None,
                   help="(default 3; --tls-only 5; quick 1)")  # fmt: skip
    p.add_argument("--tls", action="store_true", help="add the TLS rows (issue #18's ratio)")
    p.add_argument("--tls-only", action="store_true",
                   help="only ps-sync-1 without TLS and the TLS rows")  # fmt: skip
    p.add_argument("--runs", default=None, metavar="ROW,...",
                   help=f"only these rows (default: {NO_COMM},{','.join(CONFIGS)}; also "
                   f"{','.join(EXTRA_CONFIGS)}); without {NO_COMM} no exposed-comm column")  # fmt: skip
    p.add_argument(
        "--memory",
        action="store_true",
        help="only the peak-memory section (bytes/param, PS vs DDP, vs psar plan)",
    )
    p.add_argument(
        "--memory-hidden",
        type=int,
        default=None,
        help="--memory: width of the mlp's hidden layers (default 4096; quick 512)",
    )
    p.add_argument("--memory-depth", type=int, default=None,
                   help="--memory: hidden layers (default 7: 104M parameters; quick 2)")  # fmt: skip
    args = p.parse_args(argv)
    only = None if args.runs is None else [r for r in args.runs.split(",") if r]
    if only is not None and (bad := set(only) - {NO_COMM, *CONFIGS, *EXTRA_CONFIGS}):
        p.error(f"--runs: unknown {sorted(bad)}; accepted: "
                f"{', '.join([NO_COMM, *CONFIGS, *EXTRA_CONFIGS])}")  # fmt: skip
    c.install_sigterm()
    out = c.out_dir(args, "step_throughput")
    if args.memory:
        doc = memory.measure(
            out,
            hidden=args.memory_hidden or (512 if args.quick else 4096),
            depth=args.memory_depth if args.memory_depth is not None else 2 if args.quick else 7,
            steps=args.steps or 3,
            timeout=args.timeout,
        )
        return c.finish(args, out, "step_memory", doc, memory.table(doc))
    tls_ratio = args.tls_only and not args.quick
    workers = [
        int(w) for w in (args.workers or ("2" if args.quick or tls_ratio else "2,4")).split(",")
    ]
    # The TLS ratio is one number judged against 0.85: longer windows and more repeats,
    # because single runs of one configuration move by up to 15% on this machine.
    steps = args.steps or (30 if args.quick else 300 if tls_ratio else 100)
    repeats = args.repeats or (1 if args.quick else 5 if tls_ratio else 3)
    if args.tls_only:
        results = [measure_tls(out, workers=n, steps=steps, repeats=repeats, timeout=args.timeout)
                   for n in workers]  # fmt: skip
        doc = {"baseline": "psar-ps-sync-1", "results": results, "goals": tls_goals(results)}
        return c.finish(args, out, "step_throughput_tls", doc, tls_table(doc))
    results = []
    for n in workers:
        c.log(f"step_throughput: {n} workers")
        results.append(measure(out, workers=n, steps=steps, repeats=repeats,
                               timeout=args.timeout, tls=args.tls, only=only))  # fmt: skip
    doc = {"baseline": BASELINE, "results": results, "goals": goals(results)}
    return c.finish(args, out, "step_throughput", doc, table(doc))


if __name__ == "__main__":
    sys.exit(main())
