"""bench/sparse.py's `torchrec` way (issue #46 item 4): psar's side of the TorchRec baseline.

TorchRec needs fbgemm-gpu, whose CPU build is tied to one torch release, so it runs in a
venv of its own (`--torchrec-python`; bench/baselines/torchrec_venv.sh builds it, and
says why). psar is not installed there: this module, run by psar's python, writes what
the runner (bench/lib/torchrec_dmp.py) trains on, from psar's own code, so the data are
bit-identical to the other ways' and the model starts from the same weights:

- spec.pt: table sizes, dim, bag, the dense layers' shape and initial state (psar's
  recsys model built with seed 0, as `psar train --seed 0`), each table's init recipe
  (psar_init: the runner draws its rows with psar's per-block generators), the lr, and
  the held-out set where the options ask for val_samples;
- rank{R}.pt: rank R's batches of steps 0..steps-1 (psar's ShardedBatches, seed 0).

Then torchrun of that venv starts the runner with 2 ranks; the row is built from its
report and its step logs (samples/s by common.steady_rate, as for every other way).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from bench.lib import common as c

DEFAULT_PYTHON = Path("/work/venvs/torchrec/bin/python")
"""Where bench/baselines/torchrec_venv.sh builds the TorchRec venv by default."""
RUNNER = Path(__file__).resolve().parent / "torchrec_dmp.py"
PROBE = "import fbgemm_gpu, torchrec, torch; print(torch.__version__, torchrec.__file__)"


def default_python() -> str:
    """--torchrec-python's default: the venv bench/baselines/torchrec_venv.sh builds,
    where it exists."""
    return str(DEFAULT_PYTHON) if DEFAULT_PYTHON.exists() else ""


def unusable(python: str, timeout: float = 120.0) -> str | None:
    """Why `python` cannot run the torchrec way (None: it can): missing, or importing
    fbgemm_gpu/torchrec fails there (the error's last lines)."""
    if not python:
        return (f"no TorchRec venv: {DEFAULT_PYTHON} does not exist and --torchrec-python "
                "was not given (bash bench/baselines/torchrec_venv.sh builds one)")  # fmt: skip
    if not Path(python).exists():
        return f"--torchrec-python {python}: no such file"
    try:
        p = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"--torchrec-python {python}: {e}"
    if p.returncode != 0:
        tail = "\n".join(p.stderr.strip().splitlines()[-3:])
        return f"--torchrec-python {python}: importing torchrec failed: {tail}"
    return None


def write_inputs(folder: Path, opts: list[str], batch: int, steps: int, world: int,
                 lr: float) -> None:  # fmt: skip
    """spec.pt and rank{R}.pt (module docstring) for the recsys `opts` (the
    `--workload-option` list the other ways get)."""
    import torch

    from psar.worker.data import ShardedBatches
    from psar.worker.workloads import load_workload

    kv = dict(o.split("=", 1) for o in opts[1::2])
    w = load_workload("recsys", 0, kv, materialize=False)  # seed 0: psar train's default
    model = w.model
    tables = list(model.tables)
    dlrm = hasattr(model, "top")
    names = ("bottom", "top") if dlrm else ("mlp",)
    dense_state = {f"{n}.{k}": v.clone() for n in names if getattr(model, n, None) is not None
                   for k, v in getattr(model, n).state_dict().items()}  # fmt: skip
    spec = {"rows": [t.num_embeddings for t in tables], "dim": tables[0].embedding_dim,
            "bag": model.bag, "dense": getattr(model, "dense", 0), "dlrm": dlrm,
            "interaction": getattr(model, "interaction", "cat"),
            "hidden": (model.top if dlrm else model.mlp)[0].out_features,
            "init": [list(t.psar_init) for t in tables], "lr": lr,
            "dense_state": dense_state}  # fmt: skip
    if w.val_dataset is not None:
        spec["val_x"], spec["val_y"] = w.val_dataset.tensors
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(spec, folder / "spec.pt")
    for r in range(world):
        b = ShardedBatches(w.train_dataset, batch_size=batch, rank=r, world_size=world, seed=0)
        xs, ys = zip(*(b.batch(s) for s in range(steps)), strict=True)
        torch.save({"x": torch.stack(xs), "y": torch.stack(ys)}, folder / f"rank{r}.pt")


def run(t: Path, python: str, opts: list[str], batch: int, steps: int, world: int,
        lr: float, timeout: float, cpus: set[int] | None = None) -> dict:  # fmt: skip
    """The torchrec row: train under the TorchRec venv's torchrun, then read its figures."""
    write_inputs(t / "torchrec-inputs", opts, batch, steps, world, lr)
    argv = [python, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
            "--master-addr", "127.0.0.1", "--master-port", str(c.free_port()), str(RUNNER),
            "--inputs", str(t / "torchrec-inputs"), "--run-dir", str(t / "torchrec"),
            "--report", str(t / "torchrec.json")]  # fmt: skip
    with c.supervisor(t / "torchrec-logs") as sup:
        sup.start("torchrun and its torchrec ranks", argv, cpus=cpus)
        sup.wait(list(sup.children), timeout)
    rep = json.loads((t / "torchrec.json").read_text())
    return row(rep, t / "torchrec", python)


def row(rep: dict, run_dir: Path, python: str) -> dict:
    """The way's figures from the runner's report and step logs."""
    rate, window = c.steady_rate(c.load_run(run_dir))
    ranks = rep["ranks"]
    return {
        "samples_per_sec": rate,
        "window_s": window,
        "report_samples_per_sec": rep["global_samples_per_sec"],
        # Mean over ranks: row-wise sharding makes the ranks' traffic near equal.
        "bytes_per_step": sum(r["bytes_per_step"] for r in ranks) / len(ranks),
        "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in ranks],
        "worker_model_bytes": max(r["model_bytes"] for r in ranks),
        "final_loss": rep["final_train_loss"],
        "val_logloss": rep.get("val_logloss"),
        "val_auc": rep.get("val_auc"),
        "sharding": rep.get("sharding"),
        "python": python,
    }
