"""The worker's side of sparse tables under the parameter server (docs/sparse.md).

A sparse table is an ``nn.Embedding`` / ``nn.EmbeddingBag`` marked
``psar_sparse_table = True`` with ``psar_init = (std, seed)`` (the recipe of
ps/sparse_table.init_rows, so shards build their rows themselves). Such a table is
left out of the dense slot plan, and the worker does not keep it: after setup the
module's weight is an empty (0, dim) tensor. Each forward, a pre-hook

1. deduplicates the batch's ids (row_bags.batch_rows: one sort that also says where
   the batch names each row, for the table's backward; ``torch.unique`` where the
   hot-row cache serves rows or an id lies outside the table),
2. pulls only those rows from the shards holding them (row r on shard r % S),
3. installs them as the module's weight (a row cache) and remaps the ids to it.

A model that can say each table's ids of a batch before its forward (a method
``psar_table_ids(x) -> {table module name: ids}``, as the built-in ``recsys`` models do)
gets every table's rows pulled at once when its forward starts (``watch``): one frame
each way per shard and step instead of one per table. Same rows, same bits.

With ``--hot-row-cache N --hot-row-staleness S`` a table's most named rows are kept on
the worker and served for up to S steps (ps/client/hot_rows.py); only the others are
pulled.

At ``step()`` the row gradients (summed over micro-batches) are pushed, in the wire
dtype (fp16 by default), before the dense push of the same clock.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch
from torch import nn

from psar.ps import wire
from psar.ps.client import sparse_client
from psar.ps.client.hot_rows import CacheCounts, HotRowCache
from psar.ps.client.row_bags import BAG_ROWS, BatchRows, batch_rows
from psar.ps.client.row_bags import install as install_row_bag
from psar.ps.sparse_spec import TableSpec
from psar.trainkit.device_io import to_device, to_host
from psar.trainkit.finite import all_finite
from psar.trainkit.sparse_tables import marked_tables

log = logging.getLogger("psar.sparse")


def sparse_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{parameter name of the weight: module} for every table marked for the PS."""
    found = {}
    for name, mod in marked_tables(model).items():
        if getattr(mod, "padding_idx", None) is not None or mod.max_norm is not None:
            raise ValueError(f"sparse table {name}: padding_idx / max_norm not supported")
        if getattr(mod, "psar_init", None) is None:
            raise ValueError(f"sparse table {name}: set psar_init = (std, seed)")
        found[f"{name}.weight" if name else "weight"] = mod
    return found


class SparseSide:
    """Row caches, pulls and pushes of every sparse table of one PS worker."""

    def __init__(self, backend: Any, model: nn.Module) -> None:
        self.b = backend
        self.mods = sparse_modules(model)
        self.names = set(self.mods)
        ps = backend.cfg.ps
        opt = backend.cfg.optimizer
        self.wire = wire.dtype_from_name(ps.sparse_wire_dtype)
        self.pull_dtype = (
            backend.precision.weights
            if ps.sparse_pull_dtype == "auto"
            else wire.dtype_from_name(ps.sparse_pull_dtype)
        )
        """dtype rows are pulled in (--sparse-pull-dtype), then used in the model's."""
        s = len(backend.addresses)
        self.specs = {
            name: TableSpec(
                name=name,
                rows=m.num_embeddings,  # the weight may be released already (empty)
                dim=m.embedding_dim,
                optimizer=ps.sparse_optimizer,
                # --sparse-lr, else the table's own (a loop of its own: its param group's,
                # worker/hybrid.py), else --lr.
                lr=ps.sparse_lr or float(getattr(m, "psar_lr", 0.0)) or opt.lr,
                eps=ps.sparse_eps,
                beta1=opt.beta1,
                beta2=opt.beta2,
                init_std=float(m.psar_init[0]),
                init_seed=int(m.psar_init[1]),
                num_shards=s,
            )
            for name, m in self.mods.items()
        }
        self.state: dict[str, dict[str, Any]] = {}
        self.staleness: dict[str, Counter[int]] = {n: Counter() for n in self.mods}
        self.max_cached_rows: Counter[str] = Counter()
        self.bytes_pulled = 0
        self.bytes_pushed = 0
        self.steps = 0
        """Steps pushed so far: the clock the hot-row caches count their bound in."""
        self.pushed_staleness = 0
        """The largest staleness the shards measured for the last push's applied rows."""
        wire_weights = self.pull_dtype.itemsize
        self.caches = {
            name: HotRowCache(ps.hot_row_cache, ps.hot_row_staleness, sp.dim * wire_weights + 8)
            for name, sp in self.specs.items()
            if ps.hot_row_cache
        }
        self._cache_taken = CacheCounts()
        self.bag_rows: dict[str, BatchRows] = {}
        """weight name -> the last pull's BatchRows (row_bags.py: its table's backward)."""
        self.prefetched: dict[str, tuple[torch.Tensor, Any]] = {}
        """weight name -> (the batch's flat ids, _rows' result) pulled by prefetch()."""
        if self.caches and ps.hot_row_staleness == 0:
            log.info(
                "--hot-row-cache at --hot-row-staleness 0 is exact and serves no row (every "
                "row a batch names is pulled fresh); give --hot-row-staleness S >= 1 to "
                "reuse hot rows for up to S steps"
            )

    def __bool__(self) -> bool:
        return bool(self.mods)

    def setup(self) -> None:
        """Create the tables on every shard and install the hooks."""
        n = len(self.b.addresses)
        per_shard = [
            [TableSpec(**{**vars(sp), "shard_index": i}) for sp in self.specs.values()]
            for i in range(n)
        ]
        held = sparse_client.create_tables(self.b.client, per_shard)
        log.info("sparse tables: %s; bytes per shard %s", sorted(self.specs), held)
        # The weights are empty (0, dim) already: the backend released them before
        # moving the model (trainkit/sparse_tables.py), so no copy of a table is kept.
        for name, mod in self.mods.items():
            self.state[name] = {"ids": None, "acc": [], "versions": [0] * n}
            mod.register_forward_pre_hook(self._hook(name))
            # The module's weight is now the batch's rows only: a dense gradient of them
            # costs less than a sparse one coalesced and made dense (_stash), same sums.
            mod.sparse = False
            install_row_bag(mod)

    def _hook(self, name: str) -> Any:
        def hook(mod: nn.Module, args: tuple) -> tuple:
            ids, rest = args[0], args[1:]
            st = self.state[name]
            self._stash(name)
            w = mod.weight
            flat = to_host(ids).reshape(-1)
            ahead = self.prefetched.pop(name, None)
            if ahead is not None and torch.equal(ahead[0], flat):
                rows, versions, nbytes, uniq, inv = ahead[1]
            else:  # none, or the forward named other ids than psar_table_ids said
                rows, versions, nbytes, uniq, inv = self._rows(name, flat, w)
            self.bytes_pulled += nbytes
            self.b.bytes_pulled += nbytes
            if st["ids"] is None:
                st["versions"] = versions
            mod.weight = nn.Parameter(to_device(rows, w.device), requires_grad=w.requires_grad)
            st["ids"] = uniq
            self.max_cached_rows[name] = max(self.max_cached_rows[name], uniq.numel())
            remapped = to_device(inv.reshape(ids.shape), ids.device)
            told = self.bag_rows.pop(name, None)
            if told is not None and told.inv is inv:  # where the batch names each row
                setattr(mod, BAG_ROWS, (remapped, told.by_row, told.starts))
            return (remapped, *rest)

        return hook

    def _rows(
        self, name: str, ids: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, list[int], int, torch.Tensor, torch.Tensor]:
        """The rows of the batch's unique ids (served from the hot-row cache where it
        may, pulled otherwise): (rows, versions, bytes pulled, unique ids, inverse)."""
        return self._rows_of({name: (ids, w)})[name]

    def _rows_of(
        self, jobs: dict[str, tuple[torch.Tensor, torch.Tensor]]
    ) -> dict[str, tuple[torch.Tensor, list[int], int, torch.Tensor, torch.Tensor]]:
        """_rows for several tables (name -> (ids, weight)), their pulls in one call
        (sparse_client.pull_tables: one frame each way per shard)."""
        plans = {name: self._plan(name, ids, w) for name, (ids, w) in jobs.items()}
        asked = [n for n, (want, _) in plans.items() if want is not None]
        pulls = [
            sparse_client.RowsPull(n, plans[n][0], self.specs[n].dim, jobs[n][1].dtype)
            for n in asked
        ]
        got = sparse_client.pull_tables(self.b.client, pulls, self.pull_dtype)
        pulled = dict(zip(asked, got, strict=True))
        return {name: finish(pulled.get(name)) for name, (_, finish) in plans.items()}

    def _plan(self, name: str, ids: torch.Tensor, w: torch.Tensor) -> tuple[Any, Any]:
        """(the ids to pull, or None; finish(what pull_rows gave for them, or None) ->
        _rows' result): the hot-row cache's part of _rows around the pull."""
        spec, cache = self.specs[name], self.caches.get(name)
        if cache is None or not cache.serves:
            # Shard by shard: each shard's rows are one slice of the cache, pulled into
            # and pushed from without a gather or a scatter.
            shards = self.b.client.num_shards
            told = batch_rows(ids, spec.rows, shards)
            if told is None:  # ids out of range: the shards' error names them
                uniq, inv = torch.unique(ids, return_inverse=True)
                uniq, inv = sparse_client.group_by_shard(uniq, inv, shards)
            else:
                uniq, inv = told.uniq, told.inv
                self.bag_rows[name] = told
            if cache is not None:  # exact (staleness 0): looked up, never a hit
                cache.counts.lookups += uniq.numel()
            return uniq, lambda got: (*got, uniq, inv)
        uniq, inv, named = torch.unique(ids, return_inverse=True, return_counts=True)
        hit, cached = cache.lookup(uniq, self.steps)
        if cached is None:  # nothing fresh in the cache: pull all, refill it from them

            def refill(got: Any) -> Any:
                rows, versions, nbytes = got
                cache.offer(self.steps, uniq, rows, named, versions)
                return rows, versions, nbytes, uniq, inv

            return uniq, refill
        rows = torch.empty(uniq.numel(), spec.dim, dtype=w.dtype)
        rows[hit] = cached.to(w.dtype)
        miss = ~hit

        def fill(got: Any) -> Any:
            if got is None:
                return rows, list(cache.versions), 0, uniq, inv
            pulled, fresh, nbytes = got
            rows[miss] = pulled
            # The step's gradient was computed at the cached rows' (older) versions too:
            # the shards measure its staleness from the oldest.
            versions = [min(a, b) for a, b in zip(fresh, cache.versions, strict=True)]
            return rows, versions, nbytes, uniq, inv

        return (uniq[miss] if bool(miss.any()) else None), fill

    def watch(self, model: nn.Module) -> None:
        """Pull every table's rows at once when `model`'s forward starts, where it says
        each table's ids up front (``psar_table_ids``; the module docstring). `model` is
        the whole model, whose module names are the tables' (hybrid gives the PS part a
        view of the tables only)."""
        if len(self.mods) > 1 and callable(getattr(model, "psar_table_ids", None)):
            model.register_forward_pre_hook(lambda m, args: self.prefetch(m.psar_table_ids(*args)))

    def prefetch(self, ids_by_module: dict[str, torch.Tensor]) -> None:
        """Pull the rows of every table named (module name -> this batch's ids) in one
        call, for the tables' hooks to take."""
        jobs = {}
        for module, ids in ids_by_module.items():
            name = f"{module}.weight" if module else "weight"
            if name in self.mods:
                jobs[name] = (to_host(ids).reshape(-1), self.mods[name].weight)
        self.prefetched.clear()
        if not jobs:
            return
        for name, got in self._rows_of(jobs).items():
            self.prefetched[name] = (jobs[name][0], got)

    def _cache_total(self) -> CacheCounts:
        """What every table's hot-row cache served so far, together."""
        total = CacheCounts()
        for cache in self.caches.values():
            total.add(cache.counts)
        return total

    def take_cache_counts(self) -> CacheCounts:
        """What the hot-row caches served since the last call (a step's share)."""
        total = self._cache_total()
        delta = CacheCounts(
            total.lookups - self._cache_taken.lookups,
            total.hits - self._cache_taken.hits,
            total.bytes_saved - self._cache_taken.bytes_saved,
        )
        self._cache_taken = total
        return delta

    def _stash(self, name: str) -> None:
        """Keep the current micro-batch's row gradients (a later forward replaces rows)."""
        st = self.state[name]
        g = self.mods[name].weight.grad
        if st["ids"] is not None and g is not None:
            g = g.coalesce().to_dense() if g.is_sparse else g
            st["acc"].append((st["ids"], to_host(g, torch.float32)))
        self.mods[name].weight.grad = None

    def push(self, clock: int, finite: bool, loss_scale: float) -> bool:
        """Push every table's row gradients for `clock`; returns whether they were finite."""
        grads = {}
        for name in self.mods:
            self._stash(name)
            acc = self.state[name]["acc"]
            dim = self.specs[name].dim
            if len(acc) == 1:  # one micro-batch: its ids are unique already (the hook's)
                uniq, g = acc[0]
            elif acc:
                ids = torch.cat([a[0] for a in acc])
                uniq, inv = torch.unique(ids, return_inverse=True)
                g = torch.zeros(uniq.numel(), dim).index_add_(
                    0, inv, torch.cat([a[1] for a in acc])
                )
            else:
                uniq, g = torch.empty(0, dtype=torch.int64), torch.empty(0, dim)
            grads[name] = (uniq, g)
            finite = finite and all_finite([g.to(self.wire)])  # as sent
        pushes = [
            sparse_client.RowsPush(
                table=name,
                clock=clock,
                ids=uniq,
                grads=g,
                dtype=self.wire,
                base_versions=self.state[name]["versions"],
                loss_scale=loss_scale,
                overflow=not finite,
            )
            for name, (uniq, g) in grads.items()
        ]
        # All tables at once (PushTables): one round trip per step, not one per table.
        done = sparse_client.push_tables(self.b.client, pushes)
        self.pushed_staleness = 0
        for name, (replies, nbytes) in zip(grads, done, strict=True):
            st = self.state[name]
            self.bytes_pushed += nbytes
            self.b.bytes_pushed += nbytes
            for r in replies:
                if r.applied and not r.already_applied:
                    self.staleness[name][int(r.staleness)] += 1
                    self.pushed_staleness = max(self.pushed_staleness, int(r.staleness))
            st["acc"], st["ids"] = [], None
        self.steps += 1
        return finite

    def fill_state(self, state: dict[str, Any], block: int = 200_000) -> dict[str, Any]:
        """Replace the tables' (empty) entries of a state_dict with the shards' fp32 rows."""
        out = dict(state)
        for name, spec in self.specs.items():
            full = torch.empty(spec.rows, spec.dim)
            for lo in range(0, spec.rows, block):
                ids = torch.arange(lo, min(spec.rows, lo + block))
                rows, _, _ = sparse_client.pull_rows(
                    self.b.client, name, ids, spec.dim, torch.float32
                )
                full[lo : lo + len(ids)] = rows
            out[name] = full
        return out

    def _hot_report(self) -> dict[str, Any]:
        """`hot_row_cache` (with --hot-row-cache): every table's lookups, hits, hit_rate
        and bytes_saved, and their totals."""
        if not self.caches:
            return {}
        total = self._cache_total()
        ps = self.b.cfg.ps
        return {
            "hot_row_cache": {
                "rows": ps.hot_row_cache,
                "staleness": ps.hot_row_staleness,
                **total.as_dict(),
                "tables": {n: c.counts.as_dict() for n, c in self.caches.items()},
            }
        }

    def report(self) -> dict[str, Any]:
        dense = sum(p.numel() * p.element_size() for p in self.b.params.values())
        cache = sum(
            self.max_cached_rows[n] * sp.dim * self.b.precision.weights.itemsize
            for n, sp in self.specs.items()
        )
        cache += sum(c.rows.numel() * c.rows.element_size() for c in self.caches.values()
                     if c.rows is not None)  # fmt: skip
        return {
            **self._hot_report(),
            "sparse_tables": {
                n: {
                    "rows": sp.rows,
                    "dim": sp.dim,
                    "optimizer": sp.optimizer,
                    "staleness_histogram": dict(sorted(self.staleness[n].items())),
                }
                for n, sp in self.specs.items()
            },
            "sparse_bytes_pushed": self.bytes_pushed,
            "sparse_bytes_pulled": self.bytes_pulled,
            "worker_param_bytes": dense + cache,
        }
