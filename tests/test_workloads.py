"""Workload factories (mlp, lm) and the --workload spec loader."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from torch.utils.data import TensorDataset

from psar.worker.workloads import BUILTINS, Workload, load_workload
from psar.worker.workloads.lm import ByteWindows, nats_to_bits

# Small option sets keep each build well under a second.
SMALL = {
    "mlp": {"samples": "256", "val_samples": "64"},
    "lm": {"max_bytes": "60000", "seq_len": "32", "d_model": "32"},
    "recsys": {"rows": "1000,100", "dim": "8", "samples": "256", "val_samples": "64"},
}


def build(name: str, seed: int) -> Workload:
    return load_workload(name, seed, SMALL[name])


def state(w: Workload) -> dict[str, torch.Tensor]:
    return w.model.state_dict()


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_same_seed_same_weights_and_data(name: str) -> None:
    a, b = build(name, 7), build(name, 7)
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key
    for da, db in [(a.train_dataset, b.train_dataset), (a.val_dataset, b.val_dataset)]:
        assert isinstance(da, TensorDataset) and isinstance(db, TensorDataset)
        for ta, tb in zip(da.tensors, db.tensors, strict=True):
            assert torch.equal(ta, tb)


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_different_seeds_different_weights(name: str) -> None:
    sa, sb = state(build(name, 1)), state(build(name, 2))
    assert any(not torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_build_leaves_global_rng_alone(name: str) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build(name, 5)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_items_are_input_target_pairs(name: str) -> None:
    w = build(name, 0)
    x, y = w.train_dataset[0]
    assert isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
    out = w.model(x.unsqueeze(0))
    loss = w.loss_fn(out, y.unsqueeze(0))
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_mlp_loss_falls_with_sgd() -> None:
    w = load_workload("mlp", 0)
    ds = w.train_dataset
    assert isinstance(ds, TensorDataset)
    x, y = ds.tensors
    opt = torch.optim.SGD(w.model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(50):
        idx = torch.randint(len(ds), (64,), generator=gen)
        loss = w.loss_fn(w.model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > math.log(10) * 0.8  # starts near chance
    assert sum(losses[-5:]) / 5 < 0.6 * losses[0]


def test_mlp_reference_shape_options() -> None:
    w = load_workload("mlp", 0, {"in_dim": "784", "hidden": "1024", "depth": "2", "samples": "8"})
    shapes = [tuple(p.shape) for p in w.model.parameters()]
    assert shapes == [(1024, 784), (1024,), (1024, 1024), (1024,), (10, 1024), (10,)]
    assert "784-1024-1024-10" in w.description


def test_mlp_labels_use_all_classes() -> None:
    _, y = load_workload("mlp", 0).train_dataset.tensors
    assert set(y.tolist()) == set(range(10))


def test_lm_windows_are_shifted_text() -> None:
    w = build("lm", 0)
    ds = w.train_dataset
    assert isinstance(ds, ByteWindows)
    x0, y0 = ds[0]
    x1, _ = ds[1]
    assert x0.dtype == torch.long and x0.shape == (32,)
    assert torch.equal(y0[:-1], x0[1:])  # target = next byte
    assert y0[-1] == x1[0]  # windows are contiguous, non-overlapping
    assert int(x0.max()) < 256


def test_lm_val_files_disjoint_from_train() -> None:
    w = load_workload("lm", 0, {"max_bytes": "10000000"})  # all files on both sides
    train, val = w.train_dataset, w.val_dataset
    assert isinstance(train, ByteWindows) and isinstance(val, ByteWindows)
    assert train.files and val.files
    assert not set(train.files) & set(val.files)
    assert len(val.files) < len(train.files)


def test_lm_byte_budget() -> None:
    w = load_workload("lm", 0, {"max_bytes": "50000", "val_fraction": "0.2"})
    assert w.train_dataset.num_bytes == 40000
    assert w.val_dataset.num_bytes == 10000
    assert load_workload("lm", 0, {"max_bytes": "5000", "val_fraction": "0"}).val_dataset is None


def test_lm_bf16_autocast_forward_backward() -> None:
    w = build("lm", 0)
    x, y = w.train_dataset.tensors
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = w.model(x[:4])
        loss = w.loss_fn(out, y[:4])
    assert out.shape == (4, 32, 256)
    assert loss.dtype == torch.float32
    # An untrained model predicts ~uniform bytes: loss ~ ln 256.
    assert abs(loss.item() - math.log(256)) < 0.5
    loss.backward()
    grads = [p.grad for p in w.model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


def test_lm_tied_embeddings() -> None:
    model = build("lm", 0).model
    assert model.head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "head.weight" not in names


def test_lm_metric_is_bits_per_byte() -> None:
    w = build("lm", 0)
    assert w.val_metric == "bits_per_byte"
    assert w.val_value(math.log(2) * 3) == pytest.approx(3.0)
    assert nats_to_bits(math.log(256)) == pytest.approx(8.0)


@pytest.mark.parametrize(
    ("spec", "options", "match"),
    [
        ("resnet", None, r"unknown workload 'resnet'.*lm, mlp.*package\.module:function"),
        (
            "no_such_pkg_xyz.mod:make",
            None,
            r"cannot import module 'no_such_pkg_xyz\.mod'.*PYTHONPATH",
        ),
        ("psar.worker.workloads.mlp:nope", None, r"has no attribute 'nope'"),
        ("psar.worker.workloads.mlp:__doc__", None, r"not a callable factory"),
        (":make", None, r"malformed workload spec"),
        ("psar.worker.workloads.mlp:build_model", None, r"cannot call factory"),
        ("mlp", {"widht": "3"}, r"does not accept option\(s\) widht.*hidden"),
        ("mlp", {"hidden": "wide"}, r"hidden='wide': expected an integer"),
        ("lm", {"val_fraction": "2"}, r"val_fraction=2\.0: must be in"),
        ("lm", {"d_model": "30", "n_heads": "4"}, r"divisible by n_heads"),
        ("mlp", {"not a name": "1"}, r"not a valid name"),
    ],
)
def test_loader_errors(spec: str, options: dict[str, str] | None, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        load_workload(spec, 0, options)


USER_MODULE = """
import torch
from torch.utils.data import TensorDataset
from psar.worker.workloads import Workload


def make(seed, *, width="3"):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = torch.nn.Linear(int(width), 1)
    data = TensorDataset(torch.ones(8, int(width)), torch.zeros(8, 1))
    return Workload(model=model, train_dataset=data, loss_fn=torch.nn.functional.mse_loss,
                    description=f"user linear {width}")


def not_a_workload(seed):
    return {"model": None}


def broken(seed):
    import missing_dependency_xyz  # noqa: F401
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    (tmp_path / "my_user_workload.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_user_workload"


def test_user_factory(user_module: str) -> None:
    w = load_workload(f"{user_module}:make", 3, {"width": "5"})
    assert w.description == "user linear 5"
    assert w.model.weight.shape == (1, 5)
    again = load_workload(f"{user_module}:make", 3, {"width": "5"})
    assert torch.equal(w.model.weight, again.model.weight)


@pytest.mark.parametrize(
    ("func", "exc", "match"),
    [
        (
            "not_a_workload",
            ValueError,
            r"factory returned dict, expected psar\.worker\.workloads\.Workload",
        ),
        ("make_typo", ValueError, r"no attribute 'make_typo'.*make"),
        # An import error inside the factory is the user's bug: it is not disguised.
        ("broken", ModuleNotFoundError, r"missing_dependency_xyz"),
    ],
)
def test_user_factory_errors(user_module: str, func: str, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        load_workload(f"{user_module}:{func}", 0)


def test_workload_validates_fields() -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        Workload(model="not a model", train_dataset=[], loss_fn=len)  # type: ignore[arg-type]
