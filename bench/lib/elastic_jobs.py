"""bench/elastic.py's two jobs, driven by name through one interface: start(w), kill(w)
(SIGKILL: the worker and everything it started), stop(w) (SIGTERM: a preemption notice),
progress() (the share of the epoch the job has trained, from the step logs), check(),
wait_done(), final(); and each arch's fixed-size job over the same epoch.

- PSJob: one `psar server` shard and `psar train --arch ps` workers of an elastic sync
  job (`--world-size 2 --max-workers 4`, joiners `--join`), each logging into a folder
  of its own (a joiner may be given the rank of a worker that left).
- TorchrunJob: a c10d rendezvous store in a process of its own (the stable rendezvous
  host), one torchrun elastic agent per worker (`--nnodes 1:4`), each rank run through
  bench/lib/elastic_rank.py so every rendezvous round logs apart.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

from bench.lib import common as c
from psar.worker.supervisor import descendants

_SHORT = "the epoch ran out before the schedule did; give more --batches or --compute-ms"
RANK_SCRIPT = Path(__file__).resolve().parent / "elastic_rank.py"
VAL_FRACTION = 0.1


def lm_options(args: Any, max_bytes: int) -> list[str]:
    opts = {"seq_len": args.seq_len, "d_model": 32, "n_layers": 1, "n_heads": 2,
            "max_bytes": max_bytes, "val_fraction": VAL_FRACTION}  # fmt: skip
    return [f"{k}={v}" for k, v in opts.items()]


def data_size(args: Any) -> dict[str, Any]:
    """The lm options whose training set is exactly args.batches batches (so every world
    size of the schedule cuts the epoch whole), checked by building the workload."""
    from psar.worker.workloads.loader import load_workload

    want = args.batches * args.batch_size
    budget = want * args.seq_len + 1  # ByteWindows: (bytes - 1) // seq_len windows
    m = int(budget / (1 - VAL_FRACTION))
    while m - int(m * VAL_FRACTION) != budget:
        m += 1 if m - int(m * VAL_FRACTION) < budget else -1
    options = lm_options(args, m)
    kv = dict(o.split("=", 1) for o in options)
    n = len(load_workload("lm", args.seed, kv, materialize=False).train_dataset)
    if n != want:
        raise RuntimeError(f"lm with {options} has {n} training windows, not {want}")
    return {"options": options, "dataset_len": n, "planned": n}


def train_flags(args: Any, size: dict[str, Any]) -> list[str]:
    """The flags every worker of either arch runs with: one epoch of the lm workload."""
    wl = [x for o in size["options"] for x in ("--workload-option", o)]
    return ["--workload", "lm", *wl, "--batch-size", str(args.batch_size), "--seed",
            str(args.seed), "--optimizer", "adamw", "--lr", "0.002", "--precision", "fp32",
            "--torch-threads", "1", "--log-every", "0", "--eval-batches", "20",
            "--emulate-compute-ms", str(args.compute_ms), "--epochs", "1"]  # fmt: skip


class _Job:
    arch = ""

    def __init__(self, out: Path, args: Any, size: dict[str, Any]) -> None:
        self.out, self.args, self.size = out, args, size
        self.sup = c.supervisor(out)
        self.killed: set[str] = set()
        self.stopped: set[str] = set()
        self.workers: list[str] = []

    def __enter__(self) -> _Job:
        self.sup.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sup.stop()

    def _pid(self, name: str) -> int:
        return self.sup.children[name].pid

    def kill(self, name: str) -> None:
        """SIGKILL the worker and every process it started (a machine gone)."""
        if self.sup.children[name].poll() is not None:
            raise RuntimeError(f"{self.arch}: {name} ended before its SIGKILL: {_SHORT}")
        pids = [self._pid(name), *descendants([self._pid(name)])]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.killed.add(name)

    def stop(self, name: str) -> None:
        """SIGTERM: a preemption notice."""
        if self.sup.children[name].poll() is not None:
            raise RuntimeError(f"{self.arch}: {name} ended before its SIGTERM: {_SHORT}")
        os.kill(self._pid(name), signal.SIGTERM)
        self.stopped.add(name)

    def _live(self) -> list[str]:
        return [
            w for w in self.workers if w not in self.killed and self.sup.children[w].poll() is None
        ]

    def check(self, end_by: float, what: str) -> None:
        """Raise if the job is past its time, a worker failed, or every worker ended."""
        for w in self.workers:
            rc = self.sup.children[w].poll()
            if rc not in (None, 0) and w not in self.killed | self.stopped:
                raise c.ProcessError(f"{self.arch} {w} exited {rc}:\n{self.sup.tail(w)}")
        if not self._live():
            raise RuntimeError(f"{self.arch}: every worker ended while {what}: {_SHORT}")
        if time.time() > end_by:
            raise TimeoutError(f"{self.arch}: timed out {what}")

    def wait_done(self, end_by: float) -> None:
        while self._live():
            self.check(end_by, "waiting for the job to end")
            time.sleep(0.2)
        self.check_exits()

    def check_exits(self) -> None:
        for w in self.workers:
            rc = self.sup.children[w].poll()
            if w not in self.killed | self.stopped and rc != 0:
                raise c.ProcessError(f"{self.arch} {w} exited {rc}:\n{self.sup.tail(w)}")


class PSJob(_Job):
    arch = "ps"

    def __enter__(self) -> PSJob:
        super().__enter__()
        server = ["--lease-s", str(self.args.lease_s), "--join-grace-s", "60"]
        self.addr = c.start_shards(self.sup, 1, server=server)[0]
        return self

    def start(self, name: str) -> None:
        folder = self.out / "run" / name
        first = {"w0": ["--rank", "0"], "w1": ["--rank", "1"]}
        argv = [*c.PSAR, "train", "--arch", "ps", "--servers", self.addr, "--mode", "sync",
                "--world-size", "2", "--max-workers", "4", "--run-dir", str(folder),
                "--report", str(folder / "report.json"), *train_flags(self.args, self.size),
                *first.get(name, ["--join"])]  # fmt: skip
        self.sup.start(name, argv)
        self.workers.append(name)

    def settled(self) -> bool:
        """Every live worker has trained a step, and the shards' live set is the live
        workers (a killed worker's lease has run out: its rank is free again)."""
        for w in self._live():
            logs = list((self.out / "run" / w).glob("steps-ps-rank*.jsonl"))
            if not logs or not logs[0].read_text().strip():
                return False
        return self._stats()["live_workers"] == len(self._live())

    def _stats(self) -> dict[str, Any]:
        from psar.ps.client.psclient import ClientConfig, PSClient

        with PSClient([self.addr], worker=0, cfg=ClientConfig(timeout_s=5)) as client:
            return client.stats()[0]

    def progress(self) -> float:
        ids: set[int] = set()
        for path in (self.out / "run").glob("*/steps-ps-rank*.jsonl"):
            for line in path.read_text().splitlines():
                if line.endswith("}"):
                    ids.update(json.loads(line)["batches"])
        return len(ids) / self.args.batches

    def final(self) -> dict[str, Any]:
        st = self._stats()
        w0 = _reports(self.out / "run" / "w0", "report.json")  # in the job from start to end
        return {"consumed_ids": st["data_dealt"] - st["data_returned"],
                "val_loss": _val_loss(w0), "restarts": 0,
                "shard_joins": st["joins"], "shard_leaves": st["leaves"],
                "lease_expirations": st["lease_expirations"]}  # fmt: skip

    @staticmethod
    def fixed(out: Path, args: Any) -> dict[str, Any]:
        t0 = time.time()
        run = c.ps_job(out, workers=2, mode="sync", train=train_flags(args, data_size(args)),
                       server=["--lease-s", str(args.lease_s)], timeout=args.timeout)  # fmt: skip
        return {"seconds": time.time() - t0, "val_loss": _val_loss(run.summaries)}


class TorchrunJob(_Job):
    arch = "allreduce"
    #: Rendezvous settings: a short last call (30 s by default: every restart would wait it
    #: out for more nodes) and the store in a process of its own (is_host=false).
    RDZV_CONF = "is_host=false,last_call_timeout=2,join_timeout=300,close_timeout=10"
    #: torch 2.13's agents share the rendezvous store with their workers by default and
    #: keep the first round's master address: a node joining later waits for a
    #: MASTER_ADDR of its round nobody writes (60 s, then every agent fails). Opting out
    #: makes every round publish its own (pytorch/pytorch#123678).
    ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def __enter__(self) -> TorchrunJob:
        super().__enter__()
        self.port = c.free_port()
        code = ("import time, torch.distributed as d; "
                f"s = d.TCPStore('127.0.0.1', {self.port}, is_master=True, multi_tenant=True,"
                " wait_for_workers=False); print('store up', flush=True); time.sleep(1e9)")  # fmt: skip
        self.sup.start("store", [c.PY, "-c", code], persistent=True)
        self.sup.wait_line("store", re.compile("store up"), 120)
        return self

    def start(self, name: str) -> None:
        flags = [*train_flags(self.args, self.size), "--checkpoint-dir", str(self.out / "ckpt"),
                 "--checkpoint-every", str(self.args.checkpoint_every)]  # fmt: skip
        argv = [*c.TORCHRUN, "--nnodes", "1:4", "--nproc-per-node", "1", "--rdzv-backend",
                "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.port}", "--rdzv-id", "bench-elastic",
                "--rdzv-conf", self.RDZV_CONF, "--max-restarts", "100", "--monitor-interval",
                "0.5", "--local-addr", "127.0.0.1", str(RANK_SCRIPT), str(self.out / "procs"),
                "--", *flags]  # fmt: skip
        self.sup.start(name, argv, env=c.child_env(self.ENV))
        self.workers.append(name)

    def _newest(self) -> tuple[float, int, float]:
        """(start, world, furthest step as a share of the epoch) of the newest round that
        trained a step."""
        best: tuple[float, int, float] = (0.0, 0, 0.0)
        for d in (self.out / "procs").glob("p*"):
            meta, logs = d / "meta.json", list(d.glob("steps-allreduce-rank*.jsonl"))
            if not meta.exists() or not logs:
                continue
            lines = [x for x in logs[0].read_text().splitlines() if x.endswith("}")]
            if not lines:
                continue
            m = json.loads(meta.read_text())
            share = json.loads(lines[-1])["step"] * m["world"] / self.args.batches
            best = max(best, (m["start_wall"], m["world"], share))
        return best

    def settled(self) -> bool:
        """The newest round that trains holds every live agent."""
        return self._newest()[1] == len(self._live())

    def progress(self) -> float:
        return self._newest()[2]

    def final(self) -> dict[str, Any]:
        metas = []
        for d in (self.out / "procs").glob("p*"):
            if (d / "meta.json").exists():
                metas.append((json.loads((d / "meta.json").read_text()), d))
        rounds = {m["round"] for m, _ in metas}
        last = max((m["start_wall"], d) for m, d in metas if m["rank"] == 0)[1]
        reports = _reports(last, "report-*.json")
        return {"val_loss": _val_loss(reports), "restarts": len(rounds) - 1}

    @staticmethod
    def fixed(out: Path, args: Any) -> dict[str, Any]:
        t0 = time.time()
        py = [*c.psar_train_args(out), *train_flags(args, data_size(args))]
        run = c.ddp_job(out, workers=2, py_args=py, timeout=args.timeout)
        return {"seconds": time.time() - t0, "val_loss": _val_loss(run.summaries)}


def _reports(folder: Path, pattern: str) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in folder.glob(pattern)]


def _val_loss(reports: list[dict[str, Any]]) -> float | None:
    """Rank 0's validation loss (bits per byte) at the end."""
    losses = [r.get("val_loss") for r in reports if r.get("rank", 0) == 0]
    return next((v for v in losses if v is not None), None)
