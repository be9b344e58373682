"""One shard's rows of a sparse embedding table, and the sparse optimizers.

A table of `rows` x `dim` fp32 values is sharded by row: row r lives on shard
r % num_shards, at local index r // num_shards. Only rows a push names are touched:

- ``sgd``: w -= lr * g.
- ``adagrad`` (row-wise): one accumulator per row, acc += mean(g * g) over the row;
  w -= lr * g / (sqrt(acc) + eps).
- ``lazy_adam``: Adam moments and a step count per row, updated only for pushed rows;
  w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps) (torch.optim.SparseAdam's
  form) with t the row's own step count.

Untouched rows (values and optimizer state) are never written, so they stay bit for bit.
Initial values come from :func:`init_rows`, a deterministic block generator that the
workload uses for its local copy too, so no table bytes travel at start.
"""

from __future__ import annotations

from typing import Any

import torch

from psar.ps.sparse_spec import TableSpec, init_rows, local_rows


class SparseTable:
    """One shard's rows of one table with their optimizer state. Not locked: the caller
    (ps/server/sparse/tables.py) serialises calls."""

    def __init__(self, spec: TableSpec) -> None:
        self.spec = spec
        s = spec
        self.weight = init_rows(
            s.rows, s.dim, s.init_std, s.init_seed, shard=s.shard_index, num_shards=s.num_shards
        )
        n = self.weight.shape[0]
        self.acc = torch.zeros(n) if s.optimizer == "adagrad" else None
        self.m = torch.zeros(n, s.dim) if s.optimizer == "lazy_adam" else None
        self.v = torch.zeros(n, s.dim) if s.optimizer == "lazy_adam" else None
        self.steps = torch.zeros(n, dtype=torch.int64) if s.optimizer == "lazy_adam" else None
        self.version = 0
        """Updates applied to this table on this shard."""
        self._sum_buf: torch.Tensor | None = None
        """A sync round's per-row sums (_scratch)."""

    #: The optimizer's per-row state tensors, by optimizer (checkpoints carry them).
    STATE = {"sgd": (), "adagrad": ("acc",), "lazy_adam": ("m", "v", "steps")}

    def state_dict(self) -> dict[str, Any]:
        """A copy of the rows, their optimizer state and the version (for a checkpoint)."""
        out: dict[str, Any] = {"spec": dict(vars(self.spec)), "version": self.version}
        out["weight"] = self.weight.clone()
        for k in self.STATE[self.spec.optimizer]:
            out[k] = getattr(self, k).clone()
        return out

    @classmethod
    def from_state(cls, spec: TableSpec, state: dict[str, Any], *, where: str) -> SparseTable:
        """The table a state_dict describes, its tensors checked against `spec` (shapes
        and dtypes: a ValueError naming `where` and the tensor). Skips init_rows: a
        restored 10M-row table is not drawn first and then overwritten."""
        n = local_rows(spec.rows, spec.shard_index, spec.num_shards)
        want = {"weight": ((n, spec.dim), torch.float32), "acc": ((n,), torch.float32)}
        want |= {"m": ((n, spec.dim), torch.float32), "v": ((n, spec.dim), torch.float32)}
        want["steps"] = ((n,), torch.int64)
        t = cls.__new__(cls)
        t.spec = spec
        t._sum_buf = None
        t.acc = t.m = t.v = t.steps = None
        for k in ("weight", *cls.STATE[spec.optimizer]):
            v = state.get(k)
            shape, dtype = want[k]
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape or v.dtype != dtype:
                got = f"{tuple(v.shape)} {v.dtype}" if isinstance(v, torch.Tensor) else repr(v)
                raise ValueError(
                    f"{where}: sparse table {spec.name!r} ({spec.optimizer}): {k!r} should be "
                    f"{shape} {dtype}, the checkpoint holds {got}"
                )
            setattr(t, k, v.clone())
        t.version = int(state["version"])
        return t

    @property
    def nbytes(self) -> int:
        state = [self.weight, self.acc, self.m, self.v, self.steps]
        return sum(t.numel() * t.element_size() for t in state if t is not None)

    def local_index(self, ids: torch.Tensor, *, what: str) -> torch.Tensor:
        """Validate global row ids (int64, 1-D) held here, without duplicates; returns
        their local indices. Raises InvalidArgument naming the table and the bad ids."""
        from psar.ps.errors import InvalidArgument, quote  # grpc: kept out of DDP processes

        s = self.spec
        if ids.dtype != torch.int64 or ids.dim() != 1:
            raise InvalidArgument(f"{what} table {quote(s.name)}: ids must be a 1-D int64 list")
        bad = ids[(ids < 0) | (ids >= s.rows)]
        if bad.numel():
            raise InvalidArgument(
                f"{what} table {quote(s.name)}: row ids out of range [0, {s.rows}): {bad[:8].tolist()}",
                reason="bad_ids",
            )
        wrong = ids[ids % s.num_shards != s.shard_index]
        if wrong.numel():
            raise InvalidArgument(
                f"{what} table {quote(s.name)}: rows {wrong[:8].tolist()} are not held by shard "
                f"{s.shard_index} of {s.num_shards} (row r lives on shard r % {s.num_shards})",
                reason="bad_ids",
            )
        # Workers send each shard's ids sorted (torch.unique's order): strictly increasing
        # ids have no duplicates, which a linear comparison shows without a sort.
        if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
            uniq = torch.unique(ids)
        else:
            uniq = ids
        if uniq.numel() != ids.numel():
            counts = torch.bincount(torch.searchsorted(uniq, ids), minlength=uniq.numel())
            raise InvalidArgument(
                f"{what} table {quote(s.name)}: duplicate row ids {uniq[counts > 1][:8].tolist()}; "
                "deduplicate (sum their gradients) before sending",
                reason="bad_ids",
            )
        return ids // s.num_shards

    def gather(self, idx: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows `idx` (fp32), into `out` (len(idx) x dim fp32) where given."""
        if out is None:
            return self.weight.index_select(0, idx)
        return torch.index_select(self.weight, 0, idx, out=out)

    def apply(self, idx: torch.Tensor, grads: torch.Tensor) -> None:
        """One optimizer step on rows `idx` (unique local indices) with fp32 `grads`."""
        self._step_rows(idx, grads)
        self.version += 1

    def _step_rows(self, idx: torch.Tensor, grads: torch.Tensor) -> None:
        """apply's arithmetic on the rows (and their optimizer state), not its version."""
        s = self.spec
        if idx.numel():
            if s.optimizer == "sgd":
                self._add_rows(idx, grads, -s.lr)
            elif s.optimizer == "adagrad":
                assert self.acc is not None
                acc = self.acc.index_select(0, idx) + (grads * grads).mean(dim=1)
                self.acc.index_copy_(0, idx, acc)
                step = grads / (acc.sqrt() + s.eps).unsqueeze(1)
                self._add_rows(idx, step, -s.lr)
            else:
                self._lazy_adam(idx, grads)

    def _add_rows(self, idx: torch.Tensor, src: torch.Tensor, alpha: float) -> None:
        """weight[idx] += alpha * src for unique `idx`: the bits of
        weight.index_add_(0, idx, src, alpha=alpha) (the same add kernel, row by row),
        in a third less time on a large table (torch 2.13's index_add_ with an alpha
        walks the rows one add call each): the rows gathered, stepped, and put back
        through numpy's row assignment."""
        rows = self.weight.index_select(0, idx).add_(src, alpha=alpha)
        self.weight.numpy()[idx.numpy()] = rows.numpy()

    def apply_mean(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One optimizer step with the mean of several workers' row gradients (each part:
        unique local indices, fp32 grads), the parts in the order given (worker rank).
        SGD, whose step is linear in the gradient: each part stepped into the rows at
        lr / len(parts), one after another (no union of the ids, no sum buffer: ~8% more
        samples/s for a sync hybrid job at 10M rows, measured alternated). The same
        update; a row several parts name may differ from the summed mean's in its last
        bits, the same bits on every run (the order is fixed). Other optimizers, whose
        step is not linear in it (Adagrad's accumulator, Adam's moments): summed per row
        in fp32 in the parts' order, divided by their number, stepped once."""
        self._mean_rows(parts)
        self.version += 1

    def _mean_rows(self, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if self.spec.optimizer == "sgd":
            alpha = -self.spec.lr / len(parts)
            for i, grads in parts:
                if i.numel():
                    self._add_rows(i, grads, alpha)
            return
        idx = torch.cat([i for i, _ in parts])
        uniq, inv = torch.unique(idx, return_inverse=True)
        summed = self._scratch(uniq.numel())
        at = 0
        for i, grads in parts:
            summed.index_add_(0, inv[at : at + i.numel()], grads)
            at += i.numel()
        self._step_rows(uniq, summed.div_(len(parts)))

    def _scratch(self, n: int) -> torch.Tensor:
        """n x dim fp32 zeros in a buffer kept between rounds (a fresh one each round is
        a fresh mapping to fault in on a shard whose allocator maps buffers of 1 MiB or
        more: psar server --malloc-mmap-threshold-mib); grown as rounds need."""
        buf = self._sum_buf
        if buf is None or buf.shape[0] < n:
            buf = self._sum_buf = torch.empty(
                max(n, 2 * (0 if buf is None else buf.shape[0])), self.spec.dim
            )
        return buf[:n].zero_()

    def _lazy_adam(self, idx: torch.Tensor, g: torch.Tensor) -> None:
        s = self.spec
        assert self.m is not None and self.v is not None and self.steps is not None
        t = self.steps.index_select(0, idx) + 1
        self.steps.index_copy_(0, idx, t)
        m = self.m.index_select(0, idx).mul_(s.beta1).add_(g, alpha=1 - s.beta1)
        v = self.v.index_select(0, idx).mul_(s.beta2).addcmul_(g, g, value=1 - s.beta2)
        self.m.index_copy_(0, idx, m)
        self.v.index_copy_(0, idx, v)
        tf = t.to(torch.float64)
        bc1 = (1 - torch.pow(torch.tensor(s.beta1, dtype=torch.float64), tf)).float()
        bc2 = (1 - torch.pow(torch.tensor(s.beta2, dtype=torch.float64), tf)).float()
        # torch.optim.SparseAdam's form, with per-row bias corrections.
        step = m / v.sqrt().add_(s.eps) * (bc2.sqrt() / bc1).unsqueeze(1)
        self._add_rows(idx, step, -s.lr)


def dense_reference_step(
    spec: TableSpec, weight: torch.Tensor, state: dict[str, torch.Tensor], grad: torch.Tensor
) -> None:
    """The same update applied densely to a full table (tests compare against it)."""
    if spec.optimizer == "sgd":
        weight.add_(grad, alpha=-spec.lr)
    elif spec.optimizer == "adagrad":
        acc = state.setdefault("acc", torch.zeros(weight.shape[0]))
        acc.add_((grad * grad).mean(dim=1))
        weight.add_(grad / (acc.sqrt() + spec.eps).unsqueeze(1), alpha=-spec.lr)
    else:
        raise ValueError("dense reference: sgd and adagrad only (lazy_adam is row-lazy)")
