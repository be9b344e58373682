"""The loop talks to backends only through trainkit/backend.py's protocol.

Three things keep "the loop never asks which architecture it runs on" true:
- the loop reads cfg.arch in backend_class() only (its one dispatch point);
- every member the loop and its records use on a backend is declared in the protocol;
- both backends provide every declared member, built from one BackendContext.
A member used but undeclared would otherwise break only the architecture lacking it.
The protocol stays small (issue #44): a test caps its members.
"""

from __future__ import annotations

import ast
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from psar.trainkit.backend import ArchInfo, Backend, BackendContext, Dealer, describe
from psar.trainkit.config import PSConfig, TrainConfig
from psar.trainkit.precision import resolve
from psar.worker.loop import backend_class, make_backend

ROOT = Path(__file__).resolve().parents[1]
LOOP_FILES = [
    ROOT / "worker" / "loop.py",
    ROOT / "worker" / "records.py",
    ROOT / "worker" / "own_loop.py",
]
ARCHS = ("ps", "allreduce", "hybrid")


def _declared() -> dict[str, bool]:
    """Every member the protocol declares -> whether it is a method (callable)."""
    members = {name: False for name in Backend.__annotations__}
    for name, value in vars(Backend).items():
        if not name.startswith("_") and isinstance(value, classmethod | staticmethod):
            members[name] = True
        elif not name.startswith("_") and inspect.isfunction(value):
            members[name] = True
    return members


def _functions_enclosing(tree: ast.AST) -> dict[int, str]:
    """id(node) -> name of the top-level function it lies in."""
    where: dict[int, str] = {}
    for top in ast.iter_child_nodes(tree):
        if isinstance(top, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            for n in ast.walk(top):
                where[id(n)] = top.name
    return where


def _ctx(arch: str, **kw: object) -> BackendContext:
    precision = resolve(torch.device("cpu"), "fp32", "fp32", "fp32")
    return BackendContext(_cfg(arch), precision, rank=0, world_size=1, total_steps=3, **kw)


def _cfg(arch: str) -> TrainConfig:
    # A shard address is required to build a PS backend; nothing connects before setup().
    return TrainConfig(arch=arch, ps=PSConfig(servers="127.0.0.1:1"))


def test_loop_reads_arch_only_where_it_picks_the_backend() -> None:
    for path in LOOP_FILES:
        tree = ast.parse(path.read_text())
        where = _functions_enclosing(tree)
        for node in ast.walk(tree):
            reads_cfg_arch = (
                isinstance(node, ast.Attribute)
                and node.attr == "arch"
                and ast.unparse(node.value).split(".")[-1] == "cfg"
            )
            if reads_cfg_arch:
                place = where.get(id(node), "module level")
                assert (path.name, place) == ("loop.py", "backend_class"), (
                    f"{path.name}:{node.lineno} reads cfg.arch in {place}; ask the backend "
                    "(a member declared in trainkit/backend.py) instead"
                )
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("getattr", "hasattr"):
                pytest.fail(f"{path.name}:{node.lineno}: probing an object with getattr/hasattr")


def test_loop_uses_only_declared_backend_members() -> None:
    declared = _declared()
    for path in LOOP_FILES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) in (
                "backend",
                "run.backend",
                "self.backend",
            ):
                assert node.attr in declared, (
                    f"{path.name}:{node.lineno} uses backend.{node.attr}, which the Backend "
                    "protocol (trainkit/backend.py) does not declare"
                )


@pytest.mark.parametrize("arch", ARCHS)
def test_backend_provides_every_declared_member(arch: str) -> None:
    cls = backend_class(_cfg(arch))
    ctx = _ctx(arch)
    backend = make_backend(ctx)
    assert isinstance(backend, cls) and isinstance(backend, Backend)
    info = cls.describe(ctx.cfg)
    assert isinstance(info, ArchInfo) and info == describe(backend)
    assert info.arch == arch
    assert backend.ctx is ctx and backend.ctx.start_step == 0
    assert backend.dealer is None  # not an elastic job: each rank cuts its own data
    fresh = cls.describe(TrainConfig(arch=arch))
    assert (fresh.flag_rank, fresh.flag_world_size) == (-1, 0)  # nothing given: the env decides
    for name, is_method in _declared().items():
        assert hasattr(backend, name), f"{cls.__name__} lacks {name}"
        if is_method:
            want = inspect.signature(getattr(Backend, name))
            have = inspect.signature(getattr(cls, name))
            assert list(have.parameters) == list(want.parameters), (
                f"{cls.__name__}.{name}{have} differs from the protocol's {want}"
            )
            kinds = [p.kind for p in have.parameters.values()]
            assert kinds == [p.kind for p in want.parameters.values()], name
    for name in ("describe", "from_config"):
        assert name in vars(cls) or any(name in vars(b) for b in cls.__mro__[1:-1]), (
            f"{cls.__name__}.{name} must be known before any instance exists"
        )


def test_both_backends_are_built_the_same_way() -> None:
    classes = [backend_class(_cfg(a)) for a in ARCHS]
    # Parameters, names, kinds, defaults and annotations alike; each returns its own class.
    params = [inspect.signature(c.from_config).parameters for c in classes]
    assert all(p == params[0] for p in params[1:])
    assert list(params[0]) == ["ctx"], "one context object, not a list of keywords"


def test_the_protocol_stays_small() -> None:
    """Issue #44 took it from 25 members to 12: what the architecture says of a run is
    one describe(), what the report alone reads is one report(), what an elastic job
    alone needs is one part (dealer), what a worker is (and the step it resumes after)
    travels in ctx. A new member should fold into these rather than widen the protocol."""
    assert len(_declared()) <= 12, sorted(_declared())
    assert {"plan_data", "next_batches"} <= set(vars(Dealer))


@pytest.mark.parametrize("arch", ARCHS)
def test_report_gives_the_bytes_and_at_the_end_the_shards(arch: str) -> None:
    """report(): the byte counts only (each step's log line); final: the same counts,
    then "shards" (rank 0's; [] without shards), then the architecture's extras."""
    backend = make_backend(_ctx(arch))
    if arch == "allreduce":  # the extras name the optimizer setup() builds
        backend.optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        out = backend.report(final=True)
        assert list(out)[:4] == [*backend.report(), "shards"] and out["shards"] == []
    step = backend.report()
    assert {"bytes_sent", "bytes_received"} <= set(step) and "shards" not in step


@pytest.mark.parametrize(
    ("arch", "other"), [("ps", "psar.allreduce.backend"), ("allreduce", "psar.ps.client.backend")]
)
def test_picking_a_backend_loads_only_its_architecture(arch: str, other: str) -> None:
    code = (
        "import json, sys\n"
        "from psar.trainkit.config import PSConfig, TrainConfig\n"
        "from psar.worker.loop import backend_class\n"
        f"backend_class(TrainConfig(arch={arch!r}, ps=PSConfig(servers='h:1')))\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert other not in loaded, f"an {arch} run loaded {other}"
