"""ShardedBatches (deterministic per-rank shards) and evaluate()."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler, TensorDataset

from psar.worker.data import ShardedBatches, evaluate


def indexed(n: int) -> TensorDataset:
    """Item i is (i as a 1-vector, i): batches reveal which indices they hold."""
    ids = torch.arange(n)
    return TensorDataset(ids.float().unsqueeze(1), ids)


class ListDataset(Dataset):
    """A plain map-style dataset, to exercise the non-TensorDataset path."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.tensor([float(i)]), i


def shards(n: int, ws: int, bs: int, seed: int = 0) -> list[ShardedBatches]:
    ds = indexed(n)
    return [ShardedBatches(ds, batch_size=bs, rank=r, world_size=ws, seed=seed) for r in range(ws)]


def epoch_ids(sb: ShardedBatches, epoch: int) -> list[int]:
    spe = sb.steps_per_epoch()
    return [i for s in range(epoch * spe, (epoch + 1) * spe) for i in sb.batch(s)[1].tolist()]


CONFIGS = [(64, 1, 8), (64, 2, 8), (100, 3, 7), (97, 4, 5), (24, 4, 6)]


@pytest.mark.parametrize(("n", "ws", "bs"), CONFIGS)
def test_ranks_disjoint_cover_and_equal_steps(n: int, ws: int, bs: int) -> None:
    ranks = shards(n, ws, bs)
    spe = n // (ws * bs)
    assert [sb.steps_per_epoch() for sb in ranks] == [spe] * ws
    for epoch in (0, 1):
        per_rank = [epoch_ids(sb, epoch) for sb in ranks]
        assert all(len(ids) == spe * bs for ids in per_rank)
        union = [i for ids in per_rank for i in ids]
        assert len(set(union)) == len(union) == spe * ws * bs  # disjoint, nothing repeated
        assert set(union) <= set(range(n))
        if n % (ws * bs) == 0:
            assert set(union) == set(range(n))  # covering when nothing must be dropped


@pytest.mark.parametrize(("n", "ws", "bs"), CONFIGS)
def test_batches_are_full_and_stacked(n: int, ws: int, bs: int) -> None:
    sb = shards(n, ws, bs)[-1]
    for step in range(2 * sb.steps_per_epoch()):
        x, y = sb.batch(step)
        assert x.shape == (bs, 1) and y.shape == (bs,)
        assert torch.equal(x.squeeze(1).long(), y)  # inputs and targets stay paired


def test_reshuffles_every_epoch() -> None:
    sb = shards(64, 2, 8)[0]
    e0, e1, e2 = (epoch_ids(sb, e) for e in range(3))
    assert e0 != e1 and e1 != e2
    # Seeds differ per job too.
    assert epoch_ids(shards(64, 2, 8, seed=1)[0], 0) != e0


def test_matches_distributed_sampler_order() -> None:
    # Same permutation as torch's DistributedSampler; we only drop more of the tail.
    n, ws, bs, seed = 101, 3, 4, 5
    for rank, sb in enumerate(shards(n, ws, bs, seed)):
        sampler = DistributedSampler(
            range(n), num_replicas=ws, rank=rank, shuffle=True, seed=seed, drop_last=True
        )
        for epoch in (0, 1):
            sampler.set_epoch(epoch)
            ours = epoch_ids(sb, epoch)
            assert ours == list(sampler)[: len(ours)]


def test_random_access_is_deterministic() -> None:
    a, b = shards(100, 3, 7)[1], shards(100, 3, 7)[1]
    steps = [0, 1, 5, 30, 2, 0, 13, 29]
    forward = {s: a.batch(s)[1] for s in sorted(steps)}
    for s in steps:  # b jumps between epochs in a different order
        assert torch.equal(b.batch(s)[1], forward[s])


def test_same_batches_in_another_process() -> None:
    script = textwrap.dedent(
        """
        import torch
        from torch.utils.data import TensorDataset
        from psar.worker.data import ShardedBatches
        ids = torch.arange(100)
        sb = ShardedBatches(TensorDataset(ids, ids), batch_size=7, rank=2, world_size=3, seed=9)
        print([sb.batch(s)[1].tolist() for s in (0, 4, 11)])
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    ).stdout
    sb = ShardedBatches(indexed(100), batch_size=7, rank=2, world_size=3, seed=9)
    assert out.strip() == str([sb.batch(s)[1].tolist() for s in (0, 4, 11)])


def test_generic_dataset_matches_tensor_dataset() -> None:
    kw = {"batch_size": 5, "rank": 1, "world_size": 2, "seed": 3}
    fast = ShardedBatches(indexed(40), **kw)
    slow = ShardedBatches(ListDataset(40), **kw)
    for step in range(6):
        (fx, fy), (sx, sy) = fast.batch(step), slow.batch(step)
        assert torch.equal(fx, sx) and torch.equal(fy, sy)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 8, "rank": 0, "world_size": 4}, r"30 samples.*need at least 32"),
        ({"batch_size": 0, "rank": 0, "world_size": 1}, r"batch_size must be >= 1"),
        ({"batch_size": 2, "rank": 2, "world_size": 2}, r"rank must be in \[0, 2\)"),
        ({"batch_size": 2, "rank": 0, "world_size": 0}, r"world_size must be >= 1"),
    ],
)
def test_rejects_bad_arguments(kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ShardedBatches(indexed(30), seed=0, **kwargs)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out.squeeze(1) - target.float()) ** 2).mean()


def regression(n: int) -> tuple[torch.nn.Module, TensorDataset]:
    model = torch.nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(1.0)
        model.bias.fill_(0.5)  # prediction = x + 0.5 -> squared error 0.25 on every item
    return model, indexed(n)


@pytest.mark.parametrize(("batch_size", "max_batches"), [(4, None), (7, None), (100, None), (4, 2)])
def test_evaluate_mean_loss(batch_size: int, max_batches: int | None) -> None:
    model, ds = regression(10)
    assert evaluate(model, ds, mse, batch_size, None, max_batches=max_batches) == pytest.approx(
        0.25
    )


def test_evaluate_weights_batches_by_size() -> None:
    model = torch.nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(0.0)
        model.bias.fill_(0.0)
    ds = indexed(5)  # per-item loss i^2: mean over items = (0+1+4+9+16)/5 = 6
    assert evaluate(model, ds, mse, 2) == pytest.approx(6.0)
    assert evaluate(model, ds, mse, 2, max_batches=1) == pytest.approx(0.5)


@pytest.mark.parametrize("training", [True, False])
def test_evaluate_restores_mode_and_records_no_grad(training: bool) -> None:
    model, ds = regression(8)
    model = torch.nn.Sequential(model, torch.nn.Dropout(0.5))  # dropout would change the loss
    model.train(training)
    assert evaluate(model, ds, mse, 4) == pytest.approx(0.25)
    assert model.training is training
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("as_factory", [False, True])
def test_evaluate_under_autocast(as_factory: bool) -> None:
    model, ds = regression(8)
    seen = []

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.append(out.dtype)
        return mse(out, target)

    def ctx() -> torch.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16)

    result = evaluate(model, ds, loss, 4, ctx if as_factory else ctx())
    assert result == pytest.approx(0.25, rel=0.05)
    assert seen == [torch.bfloat16, torch.bfloat16]
