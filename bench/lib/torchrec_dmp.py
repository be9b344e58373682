"""TorchRec baseline of bench/sparse.py (issue #46 item 4): the `recsys` model under
TorchRec's DistributedModelParallel, CPU and gloo, 2 ranks under torchrun.

Started by the TorchRec venv's python (its own torch and fbgemm-gpu-cpu: see
bench/lib/torchrec_way.py, which writes this runner's inputs with psar's python), so
this file imports neither psar nor anything outside torch and torchrec; the pure helpers
below (rows of a table block, logloss, AUC) import torch only and are tested in psar's
venv (tests/test_bench_sparse_torchrec.py).

The model is psar's: an EmbeddingBagCollection of the recsys tables (mean pooling),
row-wise sharded over the ranks (TorchRec's sharder lists row-wise for CUDA only; the
sharder below asks for it on CPU, where its kernels run: checked by the tiny run of the
test, whose loss matches DDP-sparse's), rows initialised as psar's init_rows does; the
dense part (RecsysModel's mlp, or DLRMModel's bottom/top with cat or dot interaction)
with psar's initial weights, under DDP (DMP's default wrapper). Tables: TorchRec's fused
SGD in backward (its row-wise backward averages the ranks' row gradients, as psar's sync
shards and DDP do); dense: torch.optim.SGD, the same lr, no momentum.

Writes `steps-torchrec-rank{R}.jsonl` (psar's step-log keys: bench/lib/common.py
steady_rate reads them) and a report: bytes each rank sent + received per step, counted
at torch.distributed's collectives TorchRec calls plus DDP's ring share, peak RSS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch

BLOCK_ROWS = 65536  # psar's trainkit/sparse_tables.py BLOCK_ROWS (tested equal)


def block_rows(rows: int, dim: int, std: float, seed: int, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of psar's init_rows(rows, dim, std, seed): the same per-block
    generators, drawing only the blocks that overlap the range (a rank never draws the
    whole table)."""
    out = torch.empty(max(0, hi - lo), dim)
    for b0 in range(lo - lo % BLOCK_ROWS, hi, BLOCK_ROWS):
        n = min(BLOCK_ROWS, rows - b0)
        gen = torch.Generator().manual_seed((seed * 1_000_003 + b0 // BLOCK_ROWS) % (1 << 63))
        block = torch.randn(n, dim, generator=gen)
        a, b = max(lo, b0), min(hi, b0 + n)
        out[a - lo : b - lo] = block[a - b0 : b - b0] * std
    return out


def logloss(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean binary cross-entropy of click logits (nats), as psar's recsys loss."""
    return float(
        torch.nn.functional.binary_cross_entropy_with_logits(logits.double(), labels.double())
    )


def rank_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Exact ROC AUC: the Mann-Whitney statistic with tied scores given their mean rank.
    NaN where one class is absent."""
    s, y = scores.double().flatten(), labels.double().flatten()
    pos = float(y.sum())
    neg = len(y) - pos
    if pos == 0 or neg == 0:
        return math.nan
    order = torch.argsort(s)
    sorted_s = s[order]
    ranks = torch.empty_like(s)
    # Runs of equal scores share the mean of their 1-based positions.
    _, inverse, counts = torch.unique_consecutive(sorted_s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    mean_rank = ends - (counts.double() - 1) / 2
    ranks[order] = mean_rank[inverse]
    return float((ranks[y > 0.5].sum() - pos * (pos + 1) / 2) / (pos * neg))


def ring_bytes(payload: int, world: int) -> int:
    """Bytes one rank sends (and receives) to ring-allreduce `payload` bytes (psar's
    allreduce/backend.py ring_bytes)."""
    return 0 if world < 2 else payload * 2 * (world - 1) // world


def peak_rss_bytes() -> int:
    """This process's peak resident memory: VmHWM, else ru_maxrss (KiB on Linux)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class WireCount:
    """Bytes this rank sends + receives through the torch.distributed collectives TorchRec
    calls (patched module attributes: TorchRec looks them up as dist.X at call time).
    Per rank, the payload exchanged with the other ranks: all_to_all_single's splits less
    its own; reduce-scatter's input less its own chunk, plus that chunk from each peer;
    all-gather the same, reversed."""

    NAMES = ("all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor",
             "_reduce_scatter_base", "_all_gather_base", "all_gather", "reduce_scatter")  # fmt: skip

    def __init__(self, world: int, rank: int) -> None:
        self.world, self.rank, self.bytes, self.calls = world, rank, 0, 0

    def install(self) -> None:
        import torch.distributed as dist

        for name in self.NAMES:
            if hasattr(dist, name):
                setattr(dist, name, self._wrap(name, getattr(dist, name)))

    def _wrap(self, name: str, fn):  # noqa: ANN202 - a wrapper of torch's own signatures
        import inspect

        sig = inspect.signature(fn)
        first, second = list(sig.parameters)[:2]  # (output, input) in every one of NAMES

        def counted(*args, **kwargs):  # noqa: ANN202
            bound = sig.bind(*args, **kwargs).arguments
            self.calls += 1
            self.bytes += self._count(name, bound[first], bound[second], bound)
            return fn(*args, **kwargs)

        return counted

    def _count(self, name: str, out, inp, bound: dict) -> int:  # noqa: ANN001
        w, r = self.world, self.rank
        if name == "all_to_all_single":
            return _a2a(out, bound.get("output_split_sizes"), r, w) + _a2a(
                inp, bound.get("input_split_sizes"), r, w)  # fmt: skip
        if name in ("reduce_scatter_tensor", "_reduce_scatter_base"):
            return inp.nbytes - out.nbytes + (w - 1) * out.nbytes
        if name in ("all_gather_into_tensor", "_all_gather_base"):
            return (w - 1) * inp.nbytes + out.nbytes - inp.nbytes
        if name == "all_gather":  # (list of outputs, input)
            return 2 * (w - 1) * inp.nbytes
        if name == "reduce_scatter":  # (output, list of inputs)
            return 2 * (w - 1) * out.nbytes
        return 0


def _a2a(t: torch.Tensor, splits: list[int] | None, rank: int, world: int) -> int:
    """Bytes of an all_to_all_single buffer that go to (or come from) the other ranks."""
    if t.numel() == 0:
        return 0
    rows = t.shape[0]
    own = splits[rank] if splits else rows // world
    return (rows - own) * (t.nbytes // rows)


def _dense_modules(spec: dict) -> torch.nn.ModuleDict:
    """psar's recsys dense layers with its names (mlp; or bottom, top)."""
    nn = torch.nn
    dim, hidden, dense, tables = spec["dim"], spec["hidden"], spec["dense"], len(spec["rows"])
    if not spec["dlrm"]:
        return nn.ModuleDict({"mlp": nn.Sequential(
            nn.Linear(dim * tables, hidden), nn.ReLU(), nn.Linear(hidden, 1))})  # fmt: skip
    mods = nn.ModuleDict()
    if dense:
        mods["bottom"] = nn.Sequential(nn.Linear(dense, hidden), nn.ReLU(),
                                       nn.Linear(hidden, dim), nn.ReLU())  # fmt: skip
    n = tables + bool(dense)
    width = n * (n - 1) // 2 + dim * bool(dense) if spec["interaction"] == "dot" else n * dim
    mods["top"] = nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                                nn.ReLU(), nn.Linear(hidden, 1))  # fmt: skip
    return mods


def _model(spec: dict) -> torch.nn.Module:
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.modules.embedding_configs import PoolingType

    configs = [EmbeddingBagConfig(name=f"t{t}", embedding_dim=spec["dim"], num_embeddings=n,
                                  feature_names=[f"f{t}"], pooling=PoolingType.MEAN)
               for t, n in enumerate(spec["rows"])]  # fmt: skip

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
            self.dense = _dense_modules(spec)

        def forward(self, kjt, feats: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
            pooled = self.ebc(kjt)
            vecs = [pooled[f"f{t}"] for t in range(len(spec["rows"]))]
            d = self.dense
            if not spec["dlrm"]:
                return d["mlp"](torch.cat(vecs, dim=1)).squeeze(-1)
            if "bottom" in d:
                vecs.insert(0, d["bottom"](feats))
            if spec["interaction"] == "cat":
                return d["top"](torch.cat(vecs, dim=1)).squeeze(-1)
            z = torch.stack(vecs, dim=1)
            i, j = torch.triu_indices(len(vecs), len(vecs), offset=1)
            pairs = torch.bmm(z, z.transpose(1, 2))[:, i, j]
            feats_in = torch.cat([vecs[0], pairs], dim=1) if "bottom" in d else pairs
            return d["top"](feats_in).squeeze(-1)

    return Model()


def _kjt(x: torch.Tensor, spec: dict):  # noqa: ANN202 - a torchrec KeyedJaggedTensor
    """psar's x (dense features first, then each table's `bag` ids) as TorchRec's input."""
    from torchrec import KeyedJaggedTensor

    bag, nt, dense = spec["bag"], len(spec["rows"]), spec["dense"]
    ids = x[:, dense:].long()
    values = torch.cat([ids[:, t * bag : (t + 1) * bag].reshape(-1) for t in range(nt)])
    lengths = torch.full((nt * len(x),), bag, dtype=torch.int64)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=[f"f{t}" for t in range(nt)],
                                              values=values, lengths=lengths)  # fmt: skip
    return kjt, x[:, :dense].float()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--inputs", required=True, help="folder torchrec_way.write_inputs wrote")
    ap.add_argument("--run-dir", required=True, help="where steps-torchrec-rank{R}.jsonl go")
    ap.add_argument("--report", required=True, help="rank 0 writes the JSON report here")
    a = ap.parse_args(argv)
    import torch.distributed as dist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints
    from torchrec.distributed.types import ShardingType
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    torch.set_num_threads(1)  # as the psar ways' --torch-threads 1
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = Path(a.inputs)
    spec = torch.load(inputs / "spec.pt", weights_only=True)
    data = torch.load(inputs / f"rank{rank}.pt", weights_only=True)

    class RowWise(EmbeddingBagCollectionSharder):
        """Row-wise only: TorchRec lists it for CUDA devices, its CPU kernels run it."""

        def sharding_types(self, compute_device_type: str) -> list[str]:
            return [ShardingType.ROW_WISE.value]

    model = _model(spec)
    model.dense.load_state_dict(spec["dense_state"])
    apply_optimizer_in_backward(torch.optim.SGD, model.ebc.parameters(), {"lr": spec["lr"]})
    cons = {f"t{t}": ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value])
            for t in range(len(spec["rows"]))}  # fmt: skip
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"), constraints=cons
    )
    plan = planner.collective_plan(model, [RowWise()], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan,
                                   sharders=[RowWise()])  # fmt: skip
    state = dmp.state_dict()
    table_bytes = 0
    for t, (n, (std, seed)) in enumerate(zip(spec["rows"], spec["init"], strict=True)):
        for shard in state[f"ebc.embedding_bags.t{t}.weight"].local_shards():
            lo, size = shard.metadata.shard_offsets[0], shard.metadata.shard_sizes[0]
            for a0 in range(0, size, BLOCK_ROWS):  # a block at a time: no shard-sized copy
                a1 = min(size, a0 + BLOCK_ROWS)
                shard.tensor[a0:a1].copy_(block_rows(n, spec["dim"], std, seed, lo + a0, lo + a1))
            table_bytes += shard.tensor.nbytes
    dense_params = [p for name, p in dmp.named_parameters() if "ebc." not in name]
    dense_bytes = sum(p.nbytes for p in dense_params)
    opt = torch.optim.SGD(dense_params, lr=spec["lr"], momentum=0.0)
    wire = WireCount(world, rank)
    wire.install()
    os.makedirs(a.run_dir, exist_ok=True)
    log = open(Path(a.run_dir) / f"steps-torchrec-rank{rank}.jsonl", "w", buffering=1)  # noqa: SIM115
    xs, ys = data["x"], data["y"]
    losses: list[float] = []
    dist.barrier()
    t0, samples = time.perf_counter(), 0
    for step in range(len(xs)):
        kjt, feats = _kjt(xs[step], spec)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(dmp(kjt, feats), ys[step])
        loss.backward()  # the tables' fused SGD steps here
        opt.step()
        opt.zero_grad(set_to_none=True)
        samples += len(ys[step])
        losses.append(float(loss))
        log.write(json.dumps({"step": step + 1, "time": time.perf_counter() - t0,
                              "loss": losses[-1], "samples": samples, "rank": rank,
                              "arch": "torchrec", "mode": "sync", "wall": time.time()}) + "\n")  # fmt: skip
    wall = time.perf_counter() - t0
    log.close()
    steps = len(xs)
    sent_received = wire.bytes / steps + 2 * ring_bytes(dense_bytes, world)
    peak = peak_rss_bytes()  # training's peak, before the held-out pass gathers its scores
    ev = _evaluate(dmp, spec, rank, world)
    mine = {"rank": rank, "peak_rss_bytes": peak, "bytes_per_step": sent_received,
            "collective_calls_per_step": wire.calls / steps,
            "model_bytes": table_bytes + dense_bytes}  # fmt: skip
    every: list = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        tail = [v for v in losses[-10:] if math.isfinite(v)]  # psar's final_loss
        report = {"arch": "torchrec", "world_size": world, "steps": steps,
                  "global_samples_per_sec": world * samples / wall, "wall_seconds": wall,
                  "final_train_loss": sum(tail) / len(tail) if tail else None,
                  "ranks": every, **ev,
                  "sharding": {f"{m}.{t}": f"{ps.sharding_type} ({ps.compute_kernel}) on "
                               f"ranks {ps.ranks}" for m, mp in plan.plan.items()
                               for t, ps in mp.items()}}  # fmt: skip
        Path(a.report).write_text(json.dumps(report, indent=2) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _evaluate(dmp: torch.nn.Module, spec: dict, rank: int, world: int) -> dict:
    """Held-out logloss and AUC (where the workload has val_samples): each rank scores
    its share (every rank runs the same number of forwards: they are collective)."""
    import torch.distributed as dist

    vx, vy = spec.get("val_x"), spec.get("val_y")
    if vx is None or len(vx) < world:
        return {"val_logloss": None, "val_auc": None}
    n = len(vx) // world * world
    mine_x, mine_y = vx[rank:n:world], vy[rank:n:world]
    out = []
    with torch.no_grad():
        for i in range(0, len(mine_x), 4096):
            kjt, feats = _kjt(mine_x[i : i + 4096], spec)
            out.append(dmp(kjt, feats))
    parts: list = [None] * world
    dist.all_gather_object(parts, (torch.cat(out), mine_y))
    logits = torch.cat([p[0] for p in parts])
    labels = torch.cat([p[1] for p in parts])
    return {"val_logloss": logloss(logits, labels), "val_auc": rank_auc(logits, labels),
            "val_samples": n}  # fmt: skip


if __name__ == "__main__":
    code = main()
    # Everything is written and the process group is destroyed: leave without the
    # interpreter's teardown, where threads TorchRec's stack leaves behind are destroyed
    # while joinable now and then ("terminate called without an active exception",
    # SIGABRT after a complete run: CI's slow stage saw it once on 2 cores).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
